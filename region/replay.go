package region

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// maxReplays bounds the replays of a region that read their buffers at
// once (as many as the coordinator's moves in flight by default,
// coordinator.DefaultMaxMoves); the others wait, holding their shards'
// arrivals. Each has a consumer on the buffer stream and a pull request
// outstanding, and makes a few JetStream API requests to start: a region
// given 1 024 shards at once (a type's first allocation) started as many,
// and JetStream, under that load, could no longer renew the leases in
// time (integration.TestRebalanceAtHandoffSpeed on a 2-core machine with
// the race detector: every region fenced, coordinators stepping down, for
// two minutes). A waiting replay delays no other step: the region has
// reported the shard bound already, and the source (or the parking
// coordinator) appends the end marker without it.
const maxReplays = 64

// replayPatience is how long a replay waits, at most, for its entities to
// handle what it delivered before it may deliver more (replayTrail.wait).
const replayPatience = 30 * time.Second

// replay is the goroutine of a binding shard (modeHold): it replays the
// shard's buffer up to the end marker handoff, delivering each message to
// its entity at once (the source may still be appending meanwhile), then
// purges the buffer up to the marker, delivers the held arrivals that were
// not replayed and goes live. It ends early when ctx ends (the shard was
// dropped, or the region fenced or closed). prior, when not nil, is closed
// when the entities of the shard's previous life in this region have
// stopped; nothing is delivered before.
//
// While it replays, it also purges the buffer behind itself, up to
// messages whose deliveries were all handled, so that no entity has more
// than replayAhead keyed messages in the buffer that it handled
// (replayTrail): a target that dies here leaves the next one little to
// handle again.
func (a *Agent) replay(ctx context.Context, st *shardState, handoff uint64, prior <-chan struct{}) {
	if prior != nil {
		select {
		case <-prior:
		case <-ctx.Done():
			return
		}
	}
	select {
	case a.replays <- struct{}{}:
		defer func() { <-a.replays }()
	case <-ctx.Done():
		return
	}
	trail := newReplayTrail(replayAhead, replaySoon)
	pctx, stopPurges := context.WithCancel(ctx)
	purges := make(chan struct{})
	go func() {
		defer close(purges)
		a.purgeBehind(pctx, st, trail)
	}()
	defer func() {
		stopPurges()
		<-purges
	}()
	// A failed attempt is retried from the start of what is left of the
	// buffer: the messages read before are skipped by their sequence.
	var last uint64 // the sequence of the last message read
	read := 0
	backoff := wait.RetryFirst
	var marker uint64
	for {
		seq, err := a.cfg.Buffer.Replay(ctx, st.n, handoff, func(seq uint64, m *nats.Msg) {
			if seq <= last {
				return
			}
			last = seq
			read++
			a.deliverReplayed(st, m, trail)
			trail.read(seq)
		})
		if err == nil {
			marker = seq
			break
		}
		if ctx.Err() != nil {
			return
		}
		a.limit.log(a.log, "replay-failed", "replaying a shard's buffer failed; retrying", "shard", st.n, "handoff", handoff, "err", err)
		if !wait.Sleep(ctx, backoff) {
			return
		}
		backoff = wait.Next(backoff)
	}
	// Purge before going live: the shard's next move may start as soon as
	// it is live, and its new owner replays the buffer from the start, so
	// messages left in it would be handled twice (a load test caught that
	// when the purge came after). Held arrivals wait meanwhile. Not while
	// the region is suspended: the shard may not be its own any more.
	if !st.waitResumed() || a.purge(ctx, a.cfg.Buffer.Purge, st.n, marker) != nil {
		return
	}
	st.mu.Lock()
	st.replayed = read
	st.mu.Unlock()
	a.post(CaughtUp{Shard: st.n, Life: st.lifeN})
}

// purgeBehind purges st's buffer as far as trail allows each time trail
// asks for it (an entity has replaySoon keyed deliveries in the buffer, or
// the replay waits), until ctx ends. Not while the region is suspended,
// nor after a stall it has not yet handled: the shard may not be its own
// any more, and its next target may be replaying (what would go is
// handled here, but the next target's held copies of it would be
// delivered again).
func (a *Agent) purgeBehind(ctx context.Context, st *shardState, trail *replayTrail) {
	for {
		select {
		case <-trail.kick:
		case <-ctx.Done():
			return
		}
		upTo := trail.next()
		if upTo == 0 {
			continue
		}
		a.stallCount(true)
		if !st.waitResumed() || ctx.Err() != nil || a.purge(ctx, a.cfg.Buffer.PurgeMessages, st.n, upTo) != nil {
			return
		}
		trail.purgedTo(upTo)
	}
}

// purge removes shard's buffered messages up to and including upTo with
// purge (kvstate.Buffer's Purge, or PurgeMessages), trying again (each
// failure logged, at most every 10 s) until it has or ctx ends; it returns
// the last error then.
func (a *Agent) purge(ctx context.Context, purge func(context.Context, int, uint64) error, shard int, upTo uint64) error {
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		err := purge(ctx, shard, upTo)
		if err == nil || ctx.Err() != nil {
			return err
		}
		a.limit.log(a.log, "purge-failed", "purging a shard's buffer failed; retrying", "shard", shard, "upto", upTo, "err", err)
		if !wait.Sleep(ctx, backoff) {
			return err
		}
	}
}

// deliverReplayed hands a replayed message to its entity, unless one with
// its key (protocol.MessageKey) was delivered already (the buffer may hold
// a message twice: a publisher's retry, or a copy diverted by two
// holders). Each delivery is recorded in trail; first, for a message with
// an idempotency key, it waits while the entity has trail's limit of
// keyed deliveries in the buffer.
//
// Held arrivals come first when this message arrived here too: those that
// arrived before its copy were, for each publisher, published before it.
// Most were buffered as well, earlier, and are skipped; one that was not
// arrived while nobody diverted the shard (the parking coordinator lost
// its connection, or stepped down before the next one parked the shard
// again), or while the source could not buffer, and must keep its place
// before the later buffered messages. So when this message's own copy is
// not held yet while held arrivals wait, the subscriptions first hand
// their callbacks what they received (arrivalsCaughtUp): the own copy may
// be queued there.
func (a *Agent) deliverReplayed(st *shardState, m *nats.Msg, trail *replayTrail) {
	_, shard, id, err := a.layoutNow().ParseEntity(a.cfg.Subjects, m.Subject)
	if err == nil && shard != st.n {
		err = fmt.Errorf("%w: buffered message %q of shard %d in the buffer of shard %d", protocol.ErrWrongShard, m.Subject, shard, st.n)
	}
	if err != nil {
		a.malformed(m, err)
		return
	}
	counted := countedAs(id, m)
	ok, gaveUp := trail.wait(st.ctx, counted, replayPatience)
	if gaveUp {
		a.log.Warn("a replay waited too long for its entities to handle what it delivered; it no longer waits for them: a target that dies now may leave the next one more to handle again",
			"shard", st.n, "handoff", st.handoff, "entity", id, "waited", replayPatience)
	}
	if !ok || !st.waitResumed() {
		return // dropped: the replay is being cancelled
	}
	key := protocol.MessageKey(m.Header, m.Reply)
	st.mu.Lock()
	if key != "" && st.mayBeOvertaking(key) {
		st.mu.Unlock()
		st.arrivalsCaughtUp()
		st.mu.Lock()
	}
	if st.mode != modeHold {
		st.mu.Unlock()
		return // dropped: the replay is being cancelled
	}
	if key != "" {
		if _, dup := st.seen[key]; dup {
			st.mu.Unlock()
			a.stats.DuplicatesSkipped.Add(1)
			a.trace(st, "replayed copy skipped", key)
			return
		}
		st.seen[key] = struct{}{}
		if i, ok := st.heldAt[key]; ok && i >= st.heldNext {
			a.deliverHeldLocked(st, i, trail)
			st.heldNext, st.heldDups = i+1, st.heldDups+1 // held[i] is this message's copy
		}
	}
	a.trace(st, "replayed", key)
	a.host.DeliverTracked(st.n, id, m, trail.delivered(counted))
	st.mu.Unlock()
	a.stats.Replayed.Add(1)
}

// ownCopyWait bounds how long a replay waits for the shard's subscriptions
// to hand their callbacks what they had received (arrivalsCaughtUp).
const ownCopyWait = 2 * time.Second

// mayBeOvertaking reports whether the replayed message with key may have
// overtaken this region's own copy of it while held arrivals wait: its key
// was neither delivered nor held, and some held arrival was not delivered
// yet; st.mu is held. A held arrival that its source never buffered keeps
// its place only if the region's own copy of a later message is held
// before that message's buffered copy is replayed (see deliverReplayed).
func (st *shardState) mayBeOvertaking(key string) bool {
	if st.heldNext >= len(st.held) {
		return false
	}
	if _, dup := st.seen[key]; dup {
		return false
	}
	_, held := st.heldAt[key]
	return !held
}

// arrivalsCaughtUp waits, ownCopyWait at most, until the shard's
// subscriptions have handed their callbacks every message they had
// received: the region's own copy of a message may be queued there while
// the buffered copy is replayed (a loaded machine runs the replay before
// the subscription's callback). Campaign core seed 76: a source cut off
// from the publishers never buffered 41 - 51, which the target held; the
// target replayed the buffered copy of 52 before its callback held its
// own, so the held-first rule did not apply, and 41 - 51 went after 52.
func (st *shardState) arrivalsCaughtUp() {
	ctx, cancel := context.WithTimeout(st.ctx, ownCopyWait)
	defer cancel()
	for _, ss := range st.subs {
		_ = ss.sub.CaughtUp(ctx)
	}
}

// waitResumed waits while the region is suspended (see shardState.gate):
// a replaying shard delivers nothing then, and stays where it is in its
// buffer, since the coordinator may have given it to another region. It
// reports false when the shard's life ended meanwhile.
func (st *shardState) waitResumed() bool {
	st.mu.Lock()
	for st.mode == modeHold && st.gate != nil {
		gate := st.gate
		st.mu.Unlock()
		select {
		case <-gate:
		case <-st.ctx.Done():
			return false
		}
		st.mu.Lock()
	}
	st.mu.Unlock()
	return st.ctx.Err() == nil
}

// trace logs, at debug level, what the replay of st did with the message
// with key (protocol.MessageKey).
func (a *Agent) trace(st *shardState, what, key string) {
	if a.traceMsgs {
		a.log.Debug(what, "shard", st.n, "handoff", st.handoff, "key", key)
	}
}

// flushHeldLocked ends the holding of st's arrivals (a replay's, or a
// suspension's): it delivers those not delivered yet (deliverHeldLocked),
// forgets them and makes the shard live; st.mu is held. It returns how
// many were held and, of those, how many were skipped as copies.
func (a *Agent) flushHeldLocked(st *shardState) (held, skipped int) {
	a.deliverHeldLocked(st, len(st.held), nil)
	held, skipped = len(st.held), st.heldDups
	st.held, st.heldAt, st.heldNext, st.heldDups = nil, nil, 0, 0
	st.mode = modeLive
	return held, skipped
}

// deliverHeldLocked delivers the held arrivals from st.heldNext up to
// (not including) upTo, in arrival order, skipping those whose key
// (protocol.MessageKey) was delivered already, and moves st.heldNext to
// upTo; st.mu is held. While the shard replays, their copies in the
// buffer are skipped from then on, and trail records the deliveries.
func (a *Agent) deliverHeldLocked(st *shardState, upTo int, trail *replayTrail) {
	for _, h := range st.held[st.heldNext:upTo] {
		key := protocol.MessageKey(h.m.Header, h.m.Reply)
		if key != "" {
			if _, dup := st.seen[key]; dup {
				st.heldDups++
				continue
			}
			st.seen[key] = struct{}{}
		}
		a.trace(st, "held message delivered", key)
		var done func()
		if trail != nil {
			done = trail.delivered(countedAs(h.id, h.m))
		}
		a.host.DeliverTracked(st.n, h.id, h.m, done)
	}
	st.heldNext = upTo
}

// goLive ends the replay of st: under the shard's lock it delivers the
// held messages not delivered yet, in arrival order, skipping those whose
// key (protocol.MessageKey) was delivered, and switches the shard to live.
// It reports false when the shard was dropped meanwhile.
func (a *Agent) goLive(st *shardState) bool {
	st.mu.Lock()
	if st.mode != modeHold {
		st.mu.Unlock()
		return false
	}
	if st.gate != nil {
		// The connection dropped after the replay's end, before the core
		// heard of it (Agent.Suspend suspends at once): the shard is live
		// but suspended, its held arrivals waiting for the confirmation
		// (resume delivers them, stop refuses them).
		close(st.gate)
		st.gate = nil
		st.mode = modeSuspended
		handoff, replayed := st.handoff, st.replayed
		st.mu.Unlock()
		a.log.Debug("shard live, suspended", "shard", st.n, "handoff", handoff, "replayed", replayed)
		a.reportReplay(st.n, handoff, st.bound, replayed)
		return true
	}
	held, skipped := a.flushHeldLocked(st)
	// A copy of a replayed message may still come: the subscription may
	// not have delivered everything it received before this point (its
	// callback is busy), or a copy may be on its way. Such copies were
	// published before the source released the shard, so they come soon
	// after: the replayed ids are kept until the subscription delivered
	// what it had queued now and a release grace passed (the load test on
	// a cluster saw copies arrive 30 ms after going live).
	st.dedupUntil = st.arrivals + uint64(st.pendingOf())
	st.dedupEnd = time.Now().Add(a.cfg.ReleaseGrace)
	if len(st.seen) == 0 {
		st.seen = nil
	}
	handoff, replayed := st.handoff, st.replayed
	st.mu.Unlock()
	a.stats.DuplicatesSkipped.Add(uint64(skipped))
	a.log.Debug("shard live", "shard", st.n, "handoff", handoff, "replayed", replayed, "held", held, "duplicates_skipped", skipped)
	a.reportReplay(st.n, handoff, st.bound, replayed)
	return true
}
