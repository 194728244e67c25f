package region

import (
	"context"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// replayAhead bounds, for each entity, the messages with an idempotency
// key (protocol.IdempotencyKey) that a replay has delivered to it and not
// yet purged from the buffer: at replayAhead the replay waits until the
// buffer is purged past some of them. The purge is asked for at
// replaySoon, so that it is usually done before the replay has to wait.
//
// A binding target that dies while it replays leaves the buffer to the
// next target, which replays it from its first message: whatever the dead
// one had handled and not purged is handled again. Before, it purged only
// at the end marker, and the next target handled again everything the
// dead one had (campaign core seed 76: 206 messages; keys of an entity
// older than its window of 32 were applied twice). Now each entity is
// given again at most replayAhead of the keyed messages it handled, its
// latest, and a persistent entity that keeps the keys of its last
// SavedAnswers keyed changes (32, as the kv kind does) answers those from
// its saved answers instead of applying them (PROTOCOL.md, Handoff, "B
// dies while replaying"). Messages without a key are handled at least once, as before: they do
// not count, so that the purges, each a JetStream request that writes,
// stay few (purging every 8 messages of any kind tripled the time a
// coordinator test's replays took under load: TestStepDownWhileParked).
const (
	replayAhead = SavedAnswers // the window a persistent entity saves
	replaySoon  = replayAhead * 3 / 4
)

// countedAs is the entity that a delivery of m to entity id counts for in
// a replayTrail: id when m has an idempotency key, "" (not counted)
// otherwise.
func countedAs(id string, m *nats.Msg) string {
	if protocol.IdempotencyKey(m.Header) == "" {
		return ""
	}
	return id
}

// replayTrail is one replay's account of what it delivered and what of the
// buffer it may purge: the pure core of the purges a replay makes as it
// goes (Agent.replay). The buffer may be purged up to a message once
// every delivery the replay made up to that message (its own, and the
// held arrivals it delivered before it) has been handled (host's
// DeliverTracked): a message dropped unhandled stops the purges there.
//
// Records are kept in the order made: for each message read, the
// deliveries it led to, then the read itself. Its methods are safe for
// concurrent use (done comes from the entities' workers).
type replayTrail struct {
	limit int // replayAhead, or a test's
	soon  int // replaySoon, or a test's: an entity with this many makes the trail ask for purges

	mu   sync.Mutex
	recs []trailRec // recs[0] is the oldest record not purged
	// doneTo: recs[:doneTo] are all done (an index into recs).
	doneTo int
	// safe is the sequence of the last read in recs[:doneTo]: the buffer
	// may be purged up to it. purged is how far it was.
	safe, purged uint64
	// purgeable counts the counted deliveries a purge up to safe would
	// take; passed, those in recs[:doneTo] after safe's read.
	purgeable, passed int
	open              map[string]int // entity -> its counted deliveries in recs
	hot               int            // entities with soon or more counted deliveries in recs
	base              int            // records purged so far: recs[i] is record base+i

	gaveUp bool // wait ran out of patience: limit no longer holds

	kick  chan struct{} // a purge is wanted (one pending at most)
	freed chan struct{} // closed, and replaced, when a purge is recorded
}

// trailRec is a delivery (seq 0; id "" when it does not count) or a read
// (done from the start).
type trailRec struct {
	seq  uint64
	id   string
	done bool
}

func newReplayTrail(limit, soon int) *replayTrail {
	return &replayTrail{
		limit: limit, soon: soon, open: map[string]int{},
		kick: make(chan struct{}, 1), freed: make(chan struct{}),
	}
}

// wait waits while entity id has limit counted deliveries not purged; it reports
// false when ctx ended first. A wait longer than patience ends the bound
// for the rest of the replay (gaveUp): a message not handled for that
// long (a Handle that waits for an entity of the same shard, whose
// arrivals are held until the replay ends, or one stuck for good) holds
// the purges, and the replay goes on as it did before it purged as it
// went, rather than stop its shard.
func (t *replayTrail) wait(ctx context.Context, id string, patience time.Duration) (ok, gaveUp bool) {
	if id == "" {
		return true, false // not counted
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var timeout <-chan time.Time
	for !t.gaveUp && t.open[id] >= t.limit {
		if timeout == nil {
			tm := time.NewTimer(patience)
			defer tm.Stop()
			timeout = tm.C
		}
		freed := t.freed
		t.wantLocked()
		t.mu.Unlock()
		select {
		case <-freed:
		case <-ctx.Done():
			t.mu.Lock()
			return false, false
		case <-timeout:
			t.mu.Lock()
			t.gaveUp = true
			return true, true
		}
		t.mu.Lock()
	}
	return true, false
}

// delivered records a delivery to entity id, counted for it unless id is
// "" (a message without an idempotency key), and returns what to call
// once it was handled.
func (t *replayTrail) delivered(id string) (done func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := t.base + len(t.recs)
	t.recs = append(t.recs, trailRec{id: id})
	if id != "" {
		t.open[id]++
		if t.open[id] == t.soon {
			t.hot++
		}
	}
	return func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		t.recs[n-t.base].done = true
		t.advanceLocked()
	}
}

// read records that the message of sequence seq was read, after the
// deliveries it led to (none when it was skipped).
func (t *replayTrail) read(seq uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.recs = append(t.recs, trailRec{seq: seq, done: true})
	t.advanceLocked()
}

func (t *replayTrail) advanceLocked() {
	moved := false
	for ; t.doneTo < len(t.recs) && t.recs[t.doneTo].done; t.doneTo++ {
		switch r := t.recs[t.doneTo]; {
		case r.seq != 0:
			t.safe, moved = r.seq, true
			t.purgeable += t.passed
			t.passed = 0
		case r.id != "":
			t.passed++
		}
	}
	// A purge is asked for once it would take a few counted deliveries
	// with it, not for each one: every purge is a JetStream request that
	// writes (a waiting replay asks for one whatever it takes: wait).
	if moved && t.hot > 0 && t.purgeable >= t.limit-t.soon {
		t.wantLocked()
	}
}

// wantLocked asks for a purge, when there is something to purge.
func (t *replayTrail) wantLocked() {
	if t.safe > t.purged {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
}

// next is how far the buffer may be purged now; 0: no further than it was.
func (t *replayTrail) next() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.safe > t.purged {
		return t.safe
	}
	return 0
}

// purgedTo records that the buffer was purged up to seq (a value next
// returned): the records up to its read go.
func (t *replayTrail) purgedTo(seq uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0 // the records up to the last read of seq or before
	for i, r := range t.recs[:t.doneTo] {
		if r.seq > seq {
			break
		}
		if r.seq != 0 {
			n = i + 1
		}
	}
	for _, r := range t.recs[:n] {
		if r.seq != 0 || r.id == "" {
			continue
		}
		t.purgeable--
		if t.open[r.id] == t.soon {
			t.hot--
		}
		if t.open[r.id]--; t.open[r.id] == 0 {
			delete(t.open, r.id)
		}
	}
	clear(t.recs[:n])
	t.recs = t.recs[n:]
	t.doneTo -= n
	t.base += n
	t.purged = max(t.purged, seq)
	close(t.freed)
	t.freed = make(chan struct{})
}
