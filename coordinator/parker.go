package coordinator

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/drain"
	"github.com/natshard/natshard/internal/fanin"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// parker holds the shards that have no live owner: it subscribes to their
// subjects and diverts what arrives to their buffers (docs/PROTOCOL.md,
// "Handoff": Parking), exactly as a pausing region does.
//
// A candidate has one parker for all its terms of leadership. A term that
// ends leaves its parkings running: a leader that steps down (its lease
// renewal came too late, or a write was fenced) usually takes the lease
// again at once, and its next term adopts them (park marks them its own);
// stopping them at the end of the term would lose what is published
// between the two terms, or what the subscriptions had received and not
// yet buffered (TestStepDownWhileParked). The next term drains those it
// did not adopt (releaseOthers), and a candidate that finds another
// holding the lease drains them all (stop): it is no longer the one that
// catches those shards' messages.
type parker struct {
	nc       *nats.Conn
	buffer   *kvstate.Buffer
	subjects protocol.Subjects
	log      *slog.Logger
	stats    *Stats // nil counts nothing
	// layout is the type's shard counts, set by the leader when it takes
	// over and when it splits the type: a shard of a resharded type is
	// parked on each of its subjects (docs/PROTOCOL.md, Resharding).
	layout atomic.Pointer[protocol.Layout]

	mu     sync.Mutex
	parked map[int]*parked
}

type parked struct {
	// subs are the shard's subscriptions, one per subject it listens on,
	// oldest first (protocol.Layout.Tokens).
	subs    []*fanin.Sub
	handoff uint64
	term    uint64 // the epoch of the term that parked it, or adopted it
	// bound is set once a bind of the shard was sent while it ran (any
	// term's, and it stays set): the target subscribes before it answers
	// and holds its own copy of what arrives, so the parking is no longer
	// the only holder of a message its buffer refuses (see failed).
	bound bool
	// drained, set when sub starts draining (see draining), is closed
	// when the drain is done. A park meanwhile (a new term's) is recorded
	// in again and subscribes once the drain is done: a new
	// subscription's arrivals must not reach the buffer before what sub
	// still holds, which was published earlier.
	drained chan struct{}
	again   *parked
}

// draining reports whether pk's subscription is being drained (or was).
func (pk *parked) draining() bool { return pk.drained != nil }

func newParker(nc *nats.Conn, b *kvstate.Buffer, s protocol.Subjects, log *slog.Logger, stats *Stats) *parker {
	return &parker{nc: nc, buffer: b, subjects: s, log: log, stats: stats, parked: map[int]*parked{}}
}

// park starts diverting shard's messages for the term of epoch term, or,
// when it does already (for this term or an earlier one), records the new
// handoff id and term.
func (p *parker) park(shard int, handoff, term uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pk, ok := p.parked[shard]; ok {
		if pk.draining() {
			pk.again = &parked{handoff: handoff, term: term}
		} else {
			pk.handoff, pk.term = handoff, term
		}
		return nil
	}
	return p.subscribeLocked(shard, handoff, term, false)
}

// adopt makes shard's parking, if it runs and is not draining, the one of
// the term of epoch term under handoff; it starts none (Park.Adopt).
func (p *parker) adopt(shard int, handoff, term uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pk, ok := p.parked[shard]; ok && !pk.draining() {
		pk.handoff, pk.term = handoff, term
	}
}

// binding records that a bind of shard is about to be sent: from now on
// its target may hold its own copy of each message of the shard that the
// parking diverts (see failed).
func (p *parker) binding(shard int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pk, ok := p.parked[shard]; ok {
		pk.bound = true
		if pk.again != nil {
			pk.again.bound = true
		}
	}
}

// setLayout gives the parker the type's shard counts: the parkings that
// begin from now on listen on every subject of their shard.
func (p *parker) setLayout(l protocol.Layout) { p.layout.Store(&l) }

// subscribeLocked parks shard, on each of its subjects: a shard of a type
// never split has one; a child of a split listens on its ancestors' too,
// keeps only its own entities' messages there, and appends a message of a
// newer subject only after the older subjects' subscriptions appended
// what they had received before it (fanin: a publisher that switched to
// the new count keeps its order). p.mu is held.
func (p *parker) subscribeLocked(shard int, handoff, term uint64, bound bool) error {
	trace := p.log.Enabled(context.Background(), slog.LevelDebug)
	tokens, split := []int{shard}, false
	var layout protocol.Layout
	if l := p.layout.Load(); l != nil && l.Split() {
		layout, split, tokens = *l, true, l.Tokens(shard)
	}
	failed := func(m *nats.Msg, err error) { p.failed(shard, m, err) }
	var subs []*fanin.Sub
	for _, tok := range tokens {
		older := slices.Clone(subs)
		sub, err := fanin.Subscribe(p.nc, p.subjects.Shard(tok), func(m *nats.Msg) {
			if split {
				if _, sh, _, err := layout.ParseEntity(p.subjects, m.Subject); err != nil || sh != shard {
					return // another shard's (or malformed: the regions answer it)
				}
				for _, o := range older {
					_ = o.CaughtUp(context.Background())
				}
			}
			if trace {
				p.log.Debug("parked a message", "shard", shard, "key", protocol.MessageKey(m.Header, m.Reply))
			}
			if p.stats != nil {
				p.stats.ParkedMessages.Add(1)
			}
			p.buffer.Append(shard, m, failed)
		})
		if err != nil {
			for _, s := range subs {
				_ = s.Unsubscribe()
			}
			return err
		}
		subs = append(subs, sub)
	}
	p.parked[shard] = &parked{subs: subs, handoff: handoff, term: term, bound: bound}
	return p.nc.Flush()
}

// failed makes a refused append of shard's parking visible: a log line,
// and an error reply to a request while the parking is the shard's only
// holder. Once a bind was sent, the target may hold its own copy and
// answer it after the buffer: a refusal could be false (PROTOCOL.md, What
// a region cannot vouch for; the fault campaign saw such a "phantom").
func (p *parker) failed(shard int, m *nats.Msg, err error) {
	if p.stats != nil {
		p.stats.ParkRefused.Add(1)
	}
	if kvstate.MaybeStored(err) {
		// Not refused: it may be in the buffer, and then its next owner
		// answers it (the buffered copy keeps the reply subject).
		p.log.Warn("a parked shard's message may not have been buffered (no acknowledgement); if it was not, it is lost", "subject", m.Subject, "err", err)
		return
	}
	p.mu.Lock()
	pk, ok := p.parked[shard]
	alone := ok && !pk.bound
	p.mu.Unlock()
	if !alone {
		p.log.Warn("a parked shard's message could not be buffered; dropped unanswered (its bound owner has its own copy, if it had subscribed; if not, it is lost)", "subject", m.Subject, "err", err)
		return
	}
	p.log.Warn("a parked shard's message could not be buffered", "subject", m.Subject, "err", err)
	if m.Reply != "" {
		_ = p.nc.PublishMsg(protocol.RefusedReply(m.Reply, protocol.RefusedMoving, nil, fmt.Errorf("not buffered: %w", err)))
	}
}

// unsubscribe stops diverting shard if the term of epoch term parked it
// under handoff. It drains the subscription (package drain says why) and
// returns when it is closed.
//
// If the shard's parking is draining (an earlier term's), unsubscribe
// returns when the drain is done: the caller's end marker must come after
// what the drain buffers. A park of this term and handoff waiting for
// the drain (again) is cancelled.
func (p *parker) unsubscribe(shard int, handoff, term uint64) {
	p.mu.Lock()
	pk, ok := p.parked[shard]
	switch {
	case !ok:
		p.mu.Unlock()
	case pk.draining():
		if a := pk.again; a != nil && a.handoff == handoff && a.term == term {
			pk.again = nil
		}
		p.mu.Unlock()
		<-pk.drained
	case pk.handoff != handoff || pk.term != term:
		p.mu.Unlock()
	default:
		pk.drained = make(chan struct{})
		p.mu.Unlock()
		p.end(shard, pk)
	}
}

// end drains pk, shard's parking, marked draining, then forgets it, or
// parks the shard again for the term that asked meanwhile (pk.again).
func (p *parker) end(shard int, pk *parked) {
	defer close(pk.drained)
	for _, s := range pk.subs {
		if err := drain.Subscription(context.Background(), s.Subscription(), drainTimeout); err != nil {
			p.log.Warn("a parked shard's subscription did not drain; cut", "shard", shard, "err", err)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.parked, shard)
	if a := pk.again; a != nil {
		if err := p.subscribeLocked(shard, a.handoff, a.term, a.bound); err != nil {
			p.log.Warn("cannot park a shard again after its drain", "shard", shard, "err", err)
		}
	}
}

// drainTimeout bounds the drain of a parked shard's subscription.
const drainTimeout = 30 * time.Second

// releaseOthers starts draining the parkings of earlier terms that the
// term of epoch term has not adopted, and returns their shards.
func (p *parker) releaseOthers(term uint64) []int {
	return p.release(func(pk *parked) bool { return pk.term != term }, false)
}

// stop drains every parking and returns, with their shards, when they are
// closed: what the subscriptions received has gone to the buffers.
func (p *parker) stop() []int { return p.release(func(*parked) bool { return true }, true) }

// release drains the parkings for which which is true, all at once, and
// returns their shards, once they are closed if wait.
func (p *parker) release(which func(*parked) bool, wait bool) []int {
	p.mu.Lock()
	var shards []int
	for shard, pk := range p.parked {
		switch {
		case pk.draining():
			// Its drain ends it; it must not park it again.
			if pk.again != nil && which(pk.again) {
				pk.again = nil
			}
		case which(pk):
			pk.drained = make(chan struct{})
			shards = append(shards, shard)
		}
	}
	var wg sync.WaitGroup
	for _, shard := range shards {
		pk := p.parked[shard]
		wg.Go(func() { p.end(shard, pk) })
	}
	p.mu.Unlock()
	if wait {
		wg.Wait()
	}
	slices.Sort(shards)
	return shards
}
