package region

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// intake is how the messages of a held shard reach this region's entities:
// the data plane of one life of the shard (one bind), which the driver
// makes and changes as the core decides. There are two:
//
//   - shardState (core delivery): a core NATS subscription to the shard's
//     subjects; a bind replays the shard's handoff buffer up to its end
//     marker while it holds what arrives; a paused shard empties the
//     buffer of what it held while live (settle waits for it), then
//     appends what arrives to it; a release drains the subscription and
//     writes the end marker;
//   - streamShard (durable delivery): the shard's consumer on the type's
//     message stream, which a bind replaces (so it starts at the first
//     message nobody acknowledged); a live shard pulls and acknowledges
//     each message once its entity handled it; a paused shard stops
//     pulling and confirms its acknowledgements (settle), so that the next
//     owner gets exactly what is left.
//
// Every method but settle returns at once; none may be called before the
// bind that made the intake registered it.
type intake interface {
	life() uint64
	// goLive delivers what was held, in order, and serves the shard live.
	goLive()
	// pause stops the shard's messages from reaching the entities (for a
	// handoff: its entities stop next).
	pause(handoff uint64)
	// suspend, on a live shard, holds what arrives (core) or stops pulling
	// (durable) until resume or stop: the connection dropped. On a
	// replaying shard (core), the replay stops delivering where it is
	// until resume or stop (arrivals are held already).
	suspend()
	// resume serves a suspended shard live again: core delivery first
	// delivers what it held, in order; durable delivery starts again at
	// the first message not acknowledged. A replaying shard replays on.
	resume()
	// stop ends the shard here at once, in whatever mode (drop, fence,
	// close): nothing more reaches the entities; what was held is refused.
	stop(why string)
	// release ends the source's part of a handoff (the shard is paused
	// and its entities stopped): core delivery keeps diverting for the
	// release grace, drains the subscription and appends the end marker.
	// The agent forgets the intake first.
	release(ctx context.Context, handoff uint64) error
	// settle, after a pause and the stop of the shard's entities, waits
	// until what they handled is acknowledged (durable delivery), or
	// until the buffer is cleared of what it held while live (core).
	settle(ctx context.Context) error
	// whileLive runs f (if not nil) under the intake's lock if the shard
	// is live (not replaying, suspended, paused or gone), and reports
	// whether it is.
	whileLive(f func()) bool
}

// whileIn runs f (if not nil) under mu if *md is want, and reports whether
// it is: the intakes' whileLive, and streamShard.is.
func whileIn(mu sync.Locker, md *mode, want mode, f func()) bool {
	mu.Lock()
	defer mu.Unlock()
	if *md != want {
		return false
	}
	if f != nil {
		f()
	}
	return true
}

// core delivery: shardState (shards.go, replay.go).

func (st *shardState) life() uint64 { return st.lifeN }

func (st *shardState) goLive() { st.a.goLive(st) }

func (st *shardState) whileLive(f func()) bool { return whileIn(&st.mu, &st.mode, modeLive, f) }

func (st *shardState) suspend() {
	// What the shard's entities had queued before a stall waits for the
	// confirmation (resume, or the shard's stop or abort: host.Deliver).
	// The stall was counted before the suspension (Agent.stalled).
	st.a.host.HoldShard(st.n)
	st.mu.Lock()
	defer st.mu.Unlock()
	switch st.mode {
	case modeLive:
		st.mode = modeSuspended
		if st.seen == nil {
			st.seen = make(map[string]struct{}) // deliverHeldLocked notes the ids it delivers
		}
	case modeHold:
		// The replay stops delivering where it is (waitResumed); it keeps
		// its place and its seen keys, and arrivals are held as before.
		if st.gate == nil {
			st.gate = make(chan struct{})
		}
	}
}

func (st *shardState) resume() {
	a := st.a
	a.host.ReleaseShard(st.n)
	st.mu.Lock()
	if st.mode == modeHold {
		if st.gate != nil {
			close(st.gate)
			st.gate = nil
		}
		st.mu.Unlock()
		return
	}
	if st.mode != modeSuspended {
		st.mu.Unlock()
		return
	}
	held, skipped := a.flushHeldLocked(st)
	st.seen = nil
	st.mu.Unlock()
	a.stats.DuplicatesSkipped.Add(uint64(skipped))
	a.log.Debug("shard resumed", "shard", st.n, "held", held, "duplicates_skipped", skipped)
}

// settle waits for the clearing of the shard's buffer that pause began.
func (st *shardState) settle(ctx context.Context) error {
	st.mayComplete.Store(true) // complete may be answered from now on (appendFailed)
	st.mu.Lock()
	cleared := st.cleared
	st.mu.Unlock()
	if cleared == nil {
		return nil
	}
	select {
	case <-cleared:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (st *shardState) release(ctx context.Context, handoff uint64) error {
	a := st.a
	if !wait.Sleep(ctx, a.cfg.ReleaseGrace) {
		return ErrClosed
	}
	a.drainShard(ctx, st)
	st.forget()
	return a.mark(ctx, st.n, handoff)
}

// mark appends the end marker of a handoff to the shard's buffer.
func (a *Agent) mark(ctx context.Context, shard int, handoff uint64) error {
	if _, err := a.cfg.Buffer.Mark(ctx, shard, handoff); err != nil {
		return fmt.Errorf("end marker of shard %d: %w", shard, err)
	}
	return nil
}

// streamShard is the data plane of a held shard in durable delivery.
type streamShard struct {
	a     *Agent
	n     int
	lifeN uint64
	cons  jetstream.Consumer // set by bindDurable before the shard goes live, and by reset; mu guards it after

	mu     sync.Mutex
	mode   mode
	it     jetstream.MessagesContext // while live: pulled by pull
	pulled chan struct{}             // closed when pull returned (or never started)
	// next is the consumer sequence the next delivery must have (0: any,
	// after a reset): a gap means a delivery was lost (see deliver).
	next uint64
	// lateStarts counts the consumers in a row whose first delivery came
	// after a message the stream holds (startsLate); only pull uses it.
	lateStarts int

	// gen counts the consumers: acknowledgements of an earlier one are
	// void. Written under ackMu, read without it by deliver.
	gen atomic.Uint64
	// ackMu orders the acknowledgements (see handled and confirm).
	ackMu sync.Mutex
	last  jetstream.Msg // the last message handled, not acknowledged yet (see handled)
}

func (ss *streamShard) life() uint64 { return ss.lifeN }

func (ss *streamShard) whileLive(f func()) bool { return whileIn(&ss.mu, &ss.mode, modeLive, f) }

// is reports whether the shard is in mode m now.
func (ss *streamShard) is(m mode) bool { return whileIn(&ss.mu, &ss.mode, m, nil) }

// goLive starts pulling.
func (ss *streamShard) goLive() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.mode != modeHold {
		return
	}
	ss.mode = modeLive
	pulled := make(chan struct{})
	ss.pulled = pulled
	ss.a.goDo(func() { ss.pull(pulled) })
}

// suspend stops pulling; what the iterator still had goes back to the
// stream when its acknowledgement wait ends.
func (ss *streamShard) suspend() {
	ss.mu.Lock()
	if ss.mode != modeLive {
		ss.mu.Unlock()
		return
	}
	ss.mode = modeSuspended
	it := ss.it
	ss.it = nil
	ss.mu.Unlock()
	if it != nil {
		it.Stop()
	}
}

// resume starts pulling again from a new consumer, which starts at the
// first message not acknowledged (what the suspended iterator had is
// delivered again, in stream order), once the suspended pull returned.
func (ss *streamShard) resume() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.mode != modeSuspended {
		return
	}
	ss.mode = modeLive
	prior, pulled := ss.pulled, make(chan struct{})
	ss.pulled = pulled
	ss.a.goDo(func() {
		if prior != nil {
			<-prior
		}
		if !ss.reset() {
			close(pulled)
			return
		}
		ss.pull(pulled)
	})
}

// pull delivers the shard's messages to their entities while the shard is
// live; a message pulled when it no longer is goes back to the stream
// (Nak), for the shard's next owner. It returns when its iterator is
// closed (pause, stop), the consumer is gone (a new owner replaced it),
// or the shard is suspended (a resume starts a new pull; an older one
// that sees it returns).
func (ss *streamShard) pull(done chan struct{}) {
	defer close(done)
	a := ss.a
	backoff := wait.RetryFirst
	for {
		ss.mu.Lock()
		it, md, cons, cur := ss.it, ss.mode, ss.cons, ss.pulled
		ss.mu.Unlock()
		if md != modeLive || cur != done {
			return // paused, stopped, or suspended and resumed by another pull
		}
		if it == nil {
			var err error
			if it, err = cons.Messages(jetstream.PullMaxMessages(pullBatch)); err != nil {
				a.limit.log(a.log, "pull-failed", "cannot pull a shard's messages; retrying", "shard", ss.n, "err", err)
				if !wait.Sleep(a.ctx, backoff) {
					return
				}
				backoff = wait.Next(backoff)
				continue
			}
			ss.mu.Lock()
			if ss.mode != modeLive {
				ss.mu.Unlock()
				it.Stop()
				return
			}
			ss.it = it
			ss.mu.Unlock()
		}
		m, err := it.Next()
		if err == nil && !ss.inOrder(m) {
			// A delivery was lost: the consumer starts again at the first
			// message nobody acknowledged, in stream order, before anything
			// later reaches an entity.
			it.Stop()
			if !ss.reset() {
				return
			}
			continue
		}
		switch {
		case errors.Is(err, jetstream.ErrMsgIteratorClosed):
			ss.mu.Lock()
			again := ss.mode == modeLive && ss.it == it
			if again {
				ss.it = nil // closed under us (the connection): a new iterator
			}
			ss.mu.Unlock()
			if !again {
				return
			}
			continue
		case errors.Is(err, jetstream.ErrConsumerDeleted), errors.Is(err, jetstream.ErrConsumerNotFound),
			errors.Is(err, jetstream.ErrNoHeartbeat) && ss.missing(cons):
			if !ss.stillOwned() {
				a.log.Warn("the consumer of a shard is gone (another region took the shard): stopped pulling", "shard", ss.n)
				return
			}
			// Not a new owner's: a replacement of the consumer that an
			// earlier bind gave up on (its request timed out while the
			// servers elected leaders) was carried out late. Without a
			// new consumer the shard's messages would wait in the stream
			// for ever (TestDurableConsumerGoneUnderItsOwner).
			a.log.Warn("the consumer of a live shard is gone and the shard table still gives it to this region: a new consumer", "shard", ss.n)
			it.Stop()
			if !ss.reset() {
				return
			}
			continue
		case err != nil:
			a.limit.log(a.log, "pull-failed", "pulling a shard's messages failed; retrying", "shard", ss.n, "err", err)
			continue
		}
		backoff = wait.RetryFirst
		ss.deliver(m)
	}
}

// missing says whether cons is known to be gone from the stream. A pull
// from a consumer that does not exist (a consumer stored in memory whose
// servers restarted while the shard was not live, or one deleted between
// two pulls) gets no deletion notice, only no heartbeats.
func (ss *streamShard) missing(cons jetstream.Consumer) bool {
	ctx, cancel := context.WithTimeout(ss.a.ctx, settleWait)
	defer cancel()
	_, err := cons.Info(ctx)
	return errors.Is(err, jetstream.ErrConsumerNotFound)
}

// stillOwned reads the shard table (until it can, while the shard is
// live) and reports whether it gives the shard to this incarnation of the
// region. A new owner's bind replaces the consumer only after the table
// names it (binding), so a consumer gone while the table still names this
// region was not replaced by a new owner.
func (ss *streamShard) stillOwned() bool {
	a := ss.a
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		inc := a.viewNow().incarnation
		if !ss.is(modeLive) {
			return false
		}
		owned, err := a.tableShards(a.ctx, inc)
		if err == nil {
			return slices.Contains(owned, ss.n)
		}
		a.limit.log(a.log, "table-read-failed", "cannot read the shard table; retrying", "shard", ss.n, "err", err)
		if !wait.Sleep(a.ctx, backoff) {
			return false
		}
	}
}

// maxLateStarts bounds the consumers made again in a row because they
// started late (startsLate).
const maxLateStarts = 5

// pullBatch is how many messages a live shard's iterator keeps buffered.
const pullBatch = 256

// inOrder says whether m is the delivery that comes next: each delivery
// of a consumer has the next consumer sequence. A gap means one was lost
// on its way (its server died, say): the consumer would redeliver it only
// after AckWait, after later messages, and an entity that skips what it
// applied already (by the stream sequence) would then skip it for good.
// A new consumer's first delivery must also be where the shard's
// messages begin (startsLate). False: the consumer is to be made again.
func (ss *streamShard) inOrder(m jetstream.Msg) bool {
	md, err := m.Metadata()
	if err != nil {
		return false
	}
	ss.mu.Lock()
	first := ss.next == 0
	if !first && md.Sequence.Consumer != ss.next {
		ss.mu.Unlock()
		ss.a.log.Warn("a delivery of a shard's consumer was lost; the consumer starts again at the first message not acknowledged",
			"shard", ss.n, "expected", ss.next, "got", md.Sequence.Consumer)
		return false
	}
	ss.next = md.Sequence.Consumer + 1
	ss.mu.Unlock()
	return !first || !ss.startsLate(md.Sequence.Stream)
}

// startsLate checks the first delivery of a consumer just made (seq, its
// stream sequence) against the stream's leader: a consumer whose first
// leader chose its start from a copy of the stream that was behind starts
// past messages the stream holds, and would never deliver them; an entity
// that skips what is below its applied sequence would then lose them for
// good once a later consumer did (docs/FAULTS.md, issue 30's durable
// loss). Such a consumer is made again (true). It asks until the leader
// answers, while the shard is live.
func (ss *streamShard) startsLate(seq uint64) bool {
	a := ss.a
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		late, err := a.cfg.Stream.StartsLate(a.ctx, ss.n, seq)
		switch {
		case err == nil && !late:
			ss.lateStarts = 0
			return false
		case err == nil && ss.lateStarts >= maxLateStarts:
			// A message the leader holds though it was handled (its
			// removal lost with the consumer that acknowledged it) looks
			// the same, and would never come: go on.
			a.log.Error("a shard's new consumers keep starting past a message the stream holds; delivering from where they start",
				"shard", ss.n, "first_delivered", seq, "tries", ss.lateStarts)
			ss.lateStarts = 0
			return false
		case err == nil:
			ss.lateStarts++
			a.log.Warn("a shard's new consumer started past messages the stream holds (its first leader's copy of the stream was behind); it is made again",
				"shard", ss.n, "first_delivered", seq)
			// The copies catch up: give them a moment.
			wait.Sleep(a.ctx, time.Duration(ss.lateStarts)*200*time.Millisecond)
			return true
		}
		a.limit.log(a.log, "first-check-failed", "cannot read where a shard's messages begin in the stream; retrying", "shard", ss.n, "err", err)
		if !ss.is(modeLive) || !wait.Sleep(a.ctx, backoff) {
			return true // not live any more: the caller's reset finds so and returns
		}
	}
}

// reset replaces the shard's consumer (see Stream.ResetConsumer), still
// live; the messages the entities got from the old one and did not
// acknowledge come again (an entity that saves the applied sequence skips
// those it handled). It reports false when the shard is no longer live.
func (ss *streamShard) reset() bool {
	a := ss.a
	ss.ackMu.Lock()
	ss.gen.Add(1)
	ss.last = nil
	ss.ackMu.Unlock()
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		ss.mu.Lock()
		live := ss.mode == modeLive
		ss.it, ss.next = nil, 0
		ss.mu.Unlock()
		if !live {
			return false
		}
		cons, err := a.cfg.Stream.ResetConsumer(a.ctx, ss.n)
		if err == nil {
			ss.mu.Lock()
			ss.cons = cons
			ss.mu.Unlock()
			return true
		}
		a.limit.log(a.log, "reset-failed", "cannot replace a shard's consumer; retrying", "shard", ss.n, "err", err)
		if !wait.Sleep(a.ctx, backoff) {
			return false
		}
	}
}

// deliver gives one pulled message to its entity, if the shard is live,
// or, for an entity that a split gave to a child, forwards it (see
// forward).
func (ss *streamShard) deliver(m jetstream.Msg) {
	a := ss.a
	ss.mu.Lock()
	if ss.mode != modeLive {
		ss.mu.Unlock()
		_ = m.Nak()
		return
	}
	msg := &nats.Msg{Subject: m.Subject(), Header: m.Headers(), Data: m.Data()}
	msg.Reply = msg.Header.Get(protocol.HeaderReply)
	// The layout is read under mu: a split switches it under the
	// parents' locks (splitDurable).
	layout := a.layoutNow()
	_, _, id, err := layout.ParseEntity(a.cfg.Subjects, msg.Subject)
	next := -1
	if err == nil {
		if next = layout.Forward(ss.n, id); next < 0 {
			err = fmt.Errorf("%w: %q is not in shard %d under any of the counts %s", protocol.ErrWrongShard, id, ss.n, layout)
		}
	}
	if err != nil {
		ss.mu.Unlock()
		a.malformed(msg, err)
		_ = m.Term()
		return
	}
	md, err := m.Metadata()
	if err != nil {
		ss.mu.Unlock()
		a.limit.log(a.log, "bad-metadata", "a pulled message has no stream metadata; left to the next owner", "shard", ss.n, "err", err)
		return
	}
	gen := ss.gen.Load()
	if next == ss.n {
		a.host.DeliverDurable(ss.n, id, msg, md.Sequence.Stream, func() { ss.handled(m, gen) })
		ss.mu.Unlock()
		return
	}
	ss.mu.Unlock()
	ss.forward(m, msg, md.Sequence.Stream, next, id, gen)
}

// forward moves a message of the shard's subject whose entity a split
// gave to a child (next, the next step down the entity's line of shards:
// Layout.Forward) onto the child's subject, and acknowledges it once the
// stream stored the copy: a copy with a new stream sequence, after every
// message the child's consumer has delivered, so the entity's applied
// sequence lets it through. It runs on the pull's goroutine, one message
// at a time, so the copies keep the order of the originals. Forwarded
// again after a crash, the copy is stored once within the stream's
// duplicate window (kvstate.Stream.Forward). A message that cannot be
// stored is tried again while the shard is live; once it is not, it stays
// in the stream for the shard's next owner.
func (ss *streamShard) forward(m jetstream.Msg, msg *nats.Msg, seq uint64, next int, id string, gen uint64) {
	a := ss.a
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		err := a.cfg.Stream.Forward(a.ctx, msg, seq, next, id)
		if err == nil {
			a.stats.OldSubject.Add(1)
			ss.handled(m, gen)
			return
		}
		a.limit.log(a.log, "forward-failed", "cannot forward a message to the shard that a split gave its entity; retrying", "shard", ss.n, "to", next, "err", err)
		if !ss.is(modeLive) || !wait.Sleep(a.ctx, backoff) {
			return
		}
	}
}

// handled acknowledges the message that was handled before m and keeps m:
// the last message handled stays unacknowledged until the next one is
// handled, or until settle acknowledges it synchronously, which confirms
// every acknowledgement sent before it (the server takes a connection's
// acknowledgements of a consumer in order). A message of a consumer that
// was replaced since (gen) is not acknowledged: the new one delivers it
// again.
func (ss *streamShard) handled(m jetstream.Msg, gen uint64) {
	ss.ackMu.Lock()
	if gen != ss.gen.Load() {
		ss.ackMu.Unlock()
		return // of a replaced consumer: the new one delivers it again
	}
	prev := ss.last
	ss.last = m
	if prev != nil {
		// Under ackMu: an acknowledgement confirmed by confirm comes
		// after every one sent before it.
		_ = prev.Ack()
	}
	ss.ackMu.Unlock()
}

// pause stops pulling; what the iterator still had goes back to the
// stream.
func (ss *streamShard) pause(uint64) {
	ss.mu.Lock()
	ss.mode = modeDivert
	it := ss.it
	ss.mu.Unlock()
	if it != nil {
		it.Drain()
	}
}

// stop ends the shard at once: what is unacknowledged stays in the stream
// for the next owner.
func (ss *streamShard) stop(string) {
	ss.mu.Lock()
	ss.mode = modeGone
	it := ss.it
	ss.mu.Unlock()
	if it != nil {
		it.Stop()
	}
}

// settle waits until the pulling stopped, then acknowledges the last
// message handled synchronously and waits until the stream removed it: a
// barrier after which every message the entities handled is out of the
// stream, so the next owner gets none of them again. (On a replicated
// stream the removal follows the confirmed acknowledgement a moment
// later: kvstate.Stream.WaitRemoved.)
func (ss *streamShard) settle(ctx context.Context) error {
	if ss.pulled != nil {
		select {
		case <-ss.pulled:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return ss.confirm(ctx)
}

// confirm acknowledges the last message handled synchronously and waits
// until the stream removed it: every message handled before it is out of
// the stream then (settle; a split, before its children go live).
func (ss *streamShard) confirm(ctx context.Context) error {
	ss.ackMu.Lock()
	last := ss.last
	ss.last = nil
	ss.ackMu.Unlock()
	if last == nil {
		return nil
	}
	var err error
	for try := 0; try < 3; try++ {
		if err = last.DoubleAck(ctx); err == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return err
	}
	md, err := last.Metadata()
	if err != nil {
		return err
	}
	return ss.a.cfg.Stream.WaitRemoved(ctx, ss.n, md.Sequence.Stream)
}

// release forgets the shard: in durable delivery its next owner needs no
// end marker.
func (ss *streamShard) release(context.Context, uint64) error {
	ss.mu.Lock()
	ss.mode = modeGone
	ss.mu.Unlock()
	return nil
}

// bindDurable binds the command's shards in durable delivery: each new
// owner replaces the shard's consumer (so that it starts at the first
// message nobody acknowledged), in a goroutine that reports CaughtUp for
// each shard (once the entities of its previous life here stopped) and
// then Bound.
func (a *Agent) bindDurable(act BindShards) {
	shards := make([]*streamShard, len(act.Shards))
	priors := make([]<-chan struct{}, len(act.Shards))
	for i, n := range act.Shards {
		ss := &streamShard{a: a, n: n, lifeN: act.Lives[i], mode: modeHold}
		shards[i], priors[i] = ss, a.stopping[n]
		a.shards[n] = ss
	}
	a.goDo(func() {
		var (
			failed []int
			errs   []error
		)
		for i, ss := range shards {
			cons, err := a.cfg.Stream.ResetConsumer(a.ctx, ss.n)
			if err != nil {
				failed = append(failed, ss.n)
				errs = append(errs, fmt.Errorf("shard %d: %w", ss.n, err))
				continue // the driver forgets it (Bound)
			}
			ss.cons = cons
			if p := priors[i]; p != nil {
				select {
				case <-p:
				case <-a.ctx.Done():
					return
				}
			}
			a.post(CaughtUp{Shard: ss.n, Life: ss.lifeN})
		}
		a.post(Bound{ID: act.ID, Failed: failed, Err: errors.Join(errs...)})
	})
}

// settleWait bounds settle.
const settleWait = 5 * time.Second
