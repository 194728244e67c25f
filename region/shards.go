package region

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host"
)

// mode is what a held shard does with the messages that arrive for it.
//
//	         Bind(X,H)            marker H replayed
//	(none) ------------> hold ----------------------> live
//	                                                    |
//	  (none) <--- Release(X,H): grace, drain, mark --- divert <-- HandOff(X,H)
//
//	        connection lost                  the table still names this region
//	live ------------------> suspended -------------------------------------> live
//	                                         the table has a handoff from here
//	                         suspended -------------------------------------> divert
//
// A lost connection leaves hold and divert as they are: a replaying shard
// stops delivering where it is until the table confirms it (shardState.gate),
// a paused one goes on diverting (Core.confirmed). Drop, Fence and Close
// take any mode back to (none) at once, without end marker; so does a
// confirmation after a reconnect that finds the shard given to another
// region (see Agent.Suspend). Once a shard has left live (or hold), no message of it reaches
// the entity runtime (internal/host): the mode changes under the shard's lock, and every
// delivery happens under it.
type mode uint8

const (
	// modeGone: the shard is no longer held (dropped, released, fenced);
	// its subscription callback may still run for a message already
	// queued, which is refused as not owned.
	modeGone mode = iota
	// modeHold: bound; the buffer is being replayed to the entities and
	// arrivals are held in memory until the replay reaches the marker.
	modeHold
	// modeLive: arrivals go straight to the entities.
	modeLive
	// modeDivert: paused for a handoff; arrivals are appended to the
	// shard's buffer and the entities are stopping or stopped.
	modeDivert
	// modeClearing: paused for a handoff, the data plane only (the
	// core's mode is modeDivert): the shard's buffer is being emptied of
	// what it may hold while the shard is live, copies of messages the
	// entities handled (see shardState.pause); arrivals are held in
	// memory meanwhile, then appended, in order, and the mode becomes
	// modeDivert.
	modeClearing
	// modeSuspended: the connection to NATS dropped while the shard was
	// live. Arrivals (which come again once nats.go has resubscribed) are
	// held in memory, and a durable shard stops pulling, until the region
	// has renewed its registration and read the shard table: live again
	// if the table still names this region, dropped if not.
	modeSuspended
)

func (m mode) String() string {
	switch m {
	case modeGone:
		return "gone"
	case modeHold:
		return "replaying"
	case modeLive:
		return "live"
	case modeDivert:
		return "paused"
	case modeClearing:
		return "pausing"
	case modeSuspended:
		return "suspended"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// shardState is the data plane of one held shard: how its messages reach
// the entities (a core subscription, and the replay of its buffer while it
// binds). The driver makes one per bind (a life of the shard) and changes
// its mode as the core decides; the subscription callback reads the mode
// under the shard's own lock, never the agent's. The agent's map gives
// the current state of each shard; a state that left the map stays
// modeGone for ever, so the callbacks of a shard's earlier life can tell
// that they are stale.
//
// Lock order: shardState.mu, then Agent.subsMu; shardState.mu, then the
// entity runtime's locks (internal/host).
type shardState struct {
	a     *Agent
	n     int
	lifeN uint64 // the core's life of this bind
	// subs are the region's subscriptions the shard listens on, oldest
	// subject first, its own last (subjects.go): set once, before the
	// state is published.
	subs []*subjectSub

	mu      sync.Mutex
	mode    mode
	handoff uint64 // hold: the marker being replayed to; divert: the handoff paused for

	// clearing and divert: the connection's reconnections when the shard
	// paused, and whether it has reconnected since (see divertGap).
	pausedConn uint64
	gapped     bool

	arrivals uint64 // messages the subscription delivered to onMessage

	// hold
	held     []heldMsg           // arrivals, in order
	heldAt   map[string]int      // index in held of the first arrival with this key (protocol.MessageKey)
	heldNext int                 // held[:heldNext] were delivered or skipped (see deliverHeldLocked)
	heldDups int                 // of those, skipped as copies of delivered messages
	seen     map[string]struct{} // keys (protocol.MessageKey) of the messages delivered since the bind
	ctx      context.Context     // the life's: ended by stop and forget
	cancel   context.CancelFunc  // ends the replay (and the purge after it), and the clearing
	cleared  chan struct{}       // closed when the clearing that pause began has ended
	// gate, while replaying: not nil while the region is suspended (its
	// connection dropped); the replay delivers nothing until it is closed
	// (waitResumed).
	gate chan struct{}

	// live, just after hold: seen is kept to skip late copies of replayed
	// messages until the subscription has delivered dedupUntil arrivals
	// and dedupEnd has passed; see goLive.
	dedupUntil uint64
	dedupEnd   time.Time

	replayed int       // messages the replay delivered (for the log)
	bound    time.Time // when the shard was bound (for Config.OnStep)

	// divert: appendFailed for this shard (made once, at the pause), and
	// whether its source may have answered complete (settle began): the
	// target may be bound from then on.
	failed      func(m *nats.Msg, err error)
	mayComplete atomic.Bool
}

// lateCopy reports whether m, arriving at a live shard, is a copy of a
// message the replay delivered, and forgets the replayed keys once the
// window for such copies has closed; st.mu is held.
func (st *shardState) lateCopy(m *nats.Msg) bool {
	if key := protocol.MessageKey(m.Header, m.Reply); key != "" {
		if _, dup := st.seen[key]; dup {
			delete(st.seen, key) // a message reaches a subscription once
			return true
		}
	}
	if st.arrivals >= st.dedupUntil && time.Now().After(st.dedupEnd) {
		st.seen = nil
	}
	return false
}

// heldMsg is a message held while replaying, with its parsed entity id.
type heldMsg struct {
	id string
	m  *nats.Msg
}

// dispatch hands message m of entity id to held shard st, as its mode
// says; ss is the subscription it came from, routed by r (onSubject), and
// old says it came on one of the shard's ancestors' subjects. It runs on
// the subscription's goroutine, so the shard's messages of one subject are
// handled one at a time in arrival order, whatever the mode. It reports
// false, having done nothing, when ss's routes are no longer r (the shard
// split meanwhile): the caller routes the message again.
func (a *Agent) dispatch(st *shardState, ss *subjectSub, r *routeSet, id string, m *nats.Msg, old bool) bool {
	st.mu.Lock()
	if ss != nil && ss.routes.Load() != r {
		st.mu.Unlock()
		return false
	}
	if old {
		a.stats.OldSubject.Add(1)
	}
	a.dispatchLocked(st, id, m)
	return true
}

// dispatchLocked is dispatch, st.mu held; it unlocks it.
func (a *Agent) dispatchLocked(st *shardState, id string, m *nats.Msg) {
	st.arrivals++
	if st.mode == modeLive {
		if now, gap, stalled := a.clock.check(); stalled {
			// The region did not run for a while and the watch has not
			// handled it yet: suspend first (stall.go), then look again.
			st.mu.Unlock()
			a.stalled(gap, now)
			st.mu.Lock()
			if st.mode == modeLive {
				// Confirmed live again already (this message is the
				// shard's next, after what it held), or nothing was
				// suspended: the region is not registered, or closing.
				if _, _, stalled := a.clock.check(); stalled {
					st.mu.Unlock()
					a.notOwned(st.n)
					return
				}
			}
		}
	}
	switch st.mode {
	case modeLive:
		if st.seen != nil && st.lateCopy(m) {
			st.mu.Unlock()
			a.stats.DuplicatesSkipped.Add(1)
			return
		}
		a.host.Deliver(st.n, id, m)
		st.mu.Unlock()
	case modeHold, modeSuspended, modeClearing:
		if st.mode == modeClearing && a.divertGap(st) {
			st.mu.Unlock()
			a.dropAfterGap()
			return
		}
		if len(st.held) >= a.cfg.MaxHeld {
			clearing := st.mode == modeClearing
			st.mu.Unlock()
			a.stats.HeldOverflow.Add(1)
			if !clearing || a.mayBeForced() {
				// Another may hold a copy: a replaying shard's source
				// buffers what reaches it until its release (the grace),
				// a suspended shard may have been given away while the
				// region was off NATS, and a pausing one taken by a
				// forced reallocation. A refusal could be false (see
				// stop); a pausing source is the only holder otherwise
				// (its target is bound after the pause).
				a.limit.log(a.log, "held-overflow", "dropped a message unanswered: too many held while the shard replays its buffer, is suspended, or pauses on a suspended or stalled region", "shard", st.n, "max", a.cfg.MaxHeld)
				return
			}
			a.limit.log(a.log, "held-overflow", "refused a message: too many held while the shard pauses", "shard", st.n, "max", a.cfg.MaxHeld)
			a.reply(m, nil, refused(protocol.RefusedMoving, fmt.Errorf("shard %d is moving and region %s holds %d messages for it already", st.n, a.cfg.ID, a.cfg.MaxHeld)))
			return
		}
		if key := protocol.MessageKey(m.Header, m.Reply); key != "" {
			if st.heldAt == nil {
				st.heldAt = make(map[string]int)
			}
			if _, again := st.heldAt[key]; !again { // the first arrival is its place
				st.heldAt[key] = len(st.held)
			}
		}
		st.held = append(st.held, heldMsg{id: id, m: m})
		st.mu.Unlock()
		a.stats.Held.Add(1)
	case modeDivert:
		if a.divertGap(st) {
			st.mu.Unlock()
			a.dropAfterGap()
			return
		}
		// Append keeps the order of its calls; they all come from this
		// goroutine, under the lock. They name the handoff, which the
		// coordinator fences if it takes the shard from this region
		// without its consent (kvstate.Buffer.Fence).
		a.cfg.Buffer.AppendFrom(st.n, st.handoff, m, st.failed)
		st.mu.Unlock()
		a.stats.Buffered.Add(1)
	default:
		st.mu.Unlock()
		a.notOwned(st.n)
	}
}

// divertGap reports, st.mu held, whether the connection of paused shard
// st reconnected since the shard paused. Then what the server sent to the
// lost connection never arrived, and the buffer must end where that gap
// began: the shard's next owner holds every arrival from its bind on and
// delivers them after the buffer, so a message appended after the gap
// would be delivered before the gap's messages it holds (issue 30, the
// fault campaign: [... 100 112 101 102 ...]). From then on the shard's
// arrivals are refused, not buffered; the end marker follows on release
// as always. nats.go counts the reconnection before it subscribes again
// on the new connection, so no message of the new connection passes the
// check (docs/PROTOCOL.md, Riding through a lost connection).
func (a *Agent) divertGap(st *shardState) bool {
	if !st.gapped && a.cfg.Conn.Stats().Reconnects != st.pausedConn {
		st.gapped = true
		a.log.Warn("a paused shard's connection dropped and came back: what arrives for it is dropped, not buffered after the gap (its next owner holds it from its bind)", "shard", st.n, "handoff", st.handoff)
	}
	return st.gapped
}

// dropAfterGap counts an arrival of a paused shard that divertGap turned
// away. It is not answered: the target, bound at any time since the
// pause, holds its own copy and answers it once handled, and a refusal
// would tell the publisher that a message its next owner handles was not
// handled (the fault campaign saw such "phantom" values). One that
// arrived before the target's bind is lost, its request unanswered: the
// crash window of core delivery.
func (a *Agent) dropAfterGap() { a.stats.DroppedAfterGap.Add(1) }

// appendFailed is called by the buffer, from its own goroutine, for a
// message of paused shard st it could not buffer: the loss is counted,
// logged and, while no other region can hold the shard yet, answered.
func (a *Agent) appendFailed(st *shardState, m *nats.Msg, err error) {
	a.stats.BufferFailed.Add(1)
	if kvstate.MaybeStored(err) {
		// Not refused: it may be in the buffer, and then its next owner
		// answers it (the buffered copy keeps the reply subject).
		a.limit.log(a.log, "buffer-unknown", "a message of a paused shard may not have been buffered (no acknowledgement); if it was not, it is lost", "subject", m.Subject, "err", err)
		return
	}
	full := errors.Is(err, kvstate.ErrBufferFull)
	if full {
		a.stats.BufferFull.Add(1)
	}
	if st.mayComplete.Load() || a.mayBeForced() {
		// The source may have answered complete, and the target been
		// bound: the target holds its own copy of what arrives since, and
		// answers it after the buffer. Or the coordinator may have taken
		// the shard meanwhile (mayBeForced): then the parker has a copy.
		// A refusal could be false (PROTOCOL.md, What a region cannot
		// vouch for).
		a.limit.log(a.log, "buffer-failed", "a message of a paused shard could not be buffered; dropped unanswered (the shard's next holder, if any yet, has its own copy; if not, it is lost)", "subject", m.Subject, "err", err)
		return
	}
	a.limit.log(a.log, "buffer-failed", "a message of a paused shard could not be buffered; it is lost", "subject", m.Subject, "err", err)
	if full {
		err = fmt.Errorf("shard is moving and its buffer is full: %w", err) // names the cause: messages per shard, or no space
	} else {
		err = fmt.Errorf("shard is moving and its message could not be buffered: %w", err)
	}
	a.reply(m, nil, refused(protocol.RefusedMoving, err))
}

// mayBeForced reports whether the coordinator may have taken a shard this
// region pauses by a forced reallocation (its pause past the handoff
// timeout) without the region knowing: the region stalled, or lost its
// connection and has not confirmed its shards since. The coordinator's
// parking then holds a copy of what arrives.
func (a *Agent) mayBeForced() bool {
	_, _, stalled := a.clock.check()
	return stalled || a.viewNow().suspended
}

func (a *Agent) malformed(m *nats.Msg, err error) {
	a.stats.Malformed.Add(1)
	a.limit.log(a.log, "malformed", "dropped a malformed message", "subject", m.Subject, "err", err)
	a.reply(m, nil, refused(protocol.RefusedMalformed, err))
}

// notOwned drops a message of a shard that left the region (its
// subscription still held it), unanswered, as stop drops what the shard
// held: the shard's next holder answers its own copy.
func (a *Agent) notOwned(shard int) {
	a.stats.NotOwned.Add(1)
	a.limit.log(a.log, "not-owned", "dropped a message for a shard not served here, unanswered", "shard", shard)
}

// reply answers a request; err becomes the Natshard-Error header, and a
// refusal's reason the Natshard-Refused header. Plain publishes get no
// answer.
func (a *Agent) reply(m *nats.Msg, data []byte, err error) {
	if tooLarge := host.Answer(a.cfg.Conn, m, data, err); tooLarge != nil {
		a.limit.log(a.log, "answer-too-large", "an answer was too large to send", "subject", m.Subject, "err", tooLarge)
	}
}

// refused is host.Refused: err, answered with reason (one of protocol's
// Refused* values) in the Natshard-Refused header.
var refused = host.Refused

// bind subscribes to shard n and starts replaying its buffer up to
// marker handoff, in a goroutine that reports CaughtUp. Arrivals are held
// until the shard goes live. The driver flushes the connection.
func (a *Agent) bind(n int, handoff, life uint64) error {
	ctx, cancel := context.WithCancel(a.ctx)
	st := &shardState{a: a, n: n, lifeN: life, mode: modeHold, handoff: handoff, seen: make(map[string]struct{}), ctx: ctx, cancel: cancel, bound: time.Now()}
	if err := a.subscribeShard(st, a.layoutNow()); err != nil {
		cancel()
		return err
	}
	a.shards[n] = st
	// Entities of the shard's previous life here, if any, must have
	// stopped before the replay delivers to new ones.
	prior := a.stopping[n]
	a.goDo(func() { a.replay(ctx, st, handoff, prior) })
	return nil
}

// pause switches a live (or suspended) shard to divert for handoff: from
// now on its arrivals go to the buffer, once it is cleared; what a
// suspended shard held goes first, in order.
//
// A live shard's buffer should be empty (its replay purged it up to the
// marker it went live at), but it can hold copies of messages the
// entities handled: appended behind that marker by a parking that outlived
// its coordinator's term, or by a coordinator that parked the shard again
// after its predecessor had written the marker (PROTOCOL.md, Failures
// during a move). The next owner replays the buffer from its start, so it
// would handle them again, out of order, ids or not
// (coordinator.TestMoveIgnoresStaleBuffer). So the buffer is purged first,
// while arrivals are held (modeClearing); settle waits for it.
func (st *shardState) pause(handoff uint64) {
	st.mu.Lock()
	st.mode, st.handoff = modeClearing, handoff
	st.pausedConn, st.gapped = st.a.cfg.Conn.Stats().Reconnects, false
	st.cleared = make(chan struct{})
	if st.failed == nil {
		st.failed = func(m *nats.Msg, err error) { st.a.appendFailed(st, m, err) }
	}
	st.mu.Unlock()
	st.a.goDo(st.clear)
}

// clearBuffer empties the shard's buffer as its source pauses for handoff
// (kvstate.Buffer.Clear), retrying, unless the handoff is fenced.
func (a *Agent) clearBuffer(ctx context.Context, shard int, handoff uint64) error {
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		err := a.cfg.Buffer.Clear(ctx, shard, handoff)
		if err == nil || ctx.Err() != nil || errors.Is(err, kvstate.ErrFenced) {
			return err
		}
		a.limit.log(a.log, "purge-failed", "purging a shard's buffer failed; retrying", "shard", shard, "err", err)
		if !wait.Sleep(ctx, backoff) {
			return err
		}
	}
}

// clearWait bounds the clearing of a paused shard's buffer (below
// settleWait, which waits for it): a purge that cannot be done by then
// is given up, the copies left (a warning says so).
const clearWait = 3 * time.Second

// clear empties the buffer of a shard that pause switched to
// modeClearing, then appends what arrived meanwhile, in order, and
// diverts. A shard stopped meanwhile is left alone: stop dropped what it
// held.
func (st *shardState) clear() {
	a := st.a
	defer close(st.cleared)
	ctx, cancel := context.WithTimeout(st.ctx, clearWait)
	err := a.clearBuffer(ctx, st.n, st.handoff)
	cancel()
	if st.ctx.Err() != nil {
		return
	}
	if errors.Is(err, kvstate.ErrFenced) {
		// What arrived meanwhile stays held, never appended: the Unbind
		// that SourceFenced brings drops it unanswered (the coordinator,
		// which fenced the handoff, parks the shard and has its own copy).
		a.stats.SourceFenced.Add(1)
		a.post(SourceFenced{Shard: st.n, Life: st.lifeN})
		return
	}
	if err != nil {
		a.log.Warn("cannot empty a paused shard's buffer of what it held while live; its next owner may handle those copies again", "shard", st.n, "err", err)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.mode != modeClearing {
		return
	}
	// What a suspension held is paused here too (a handoff that the
	// coordinator started while the region was away; Core.confirmed): a
	// copy of a message the entities handled (a replay's late copy,
	// st.seen) is not buffered again.
	appended := 0
	for _, h := range st.held[st.heldNext:] {
		if key := protocol.MessageKey(h.m.Header, h.m.Reply); key != "" && st.seen != nil {
			if _, dup := st.seen[key]; dup {
				a.stats.DuplicatesSkipped.Add(1)
				continue
			}
		}
		a.cfg.Buffer.AppendFrom(st.n, st.handoff, h.m, st.failed)
		appended++
	}
	a.stats.Buffered.Add(uint64(appended))
	st.held, st.heldAt, st.heldNext, st.heldDups = nil, nil, 0, 0
	st.mode = modeDivert
}

// stop unsubscribes the shard at once, in whatever mode, ends its replay
// and drops what it held, unanswered; no end marker is written.
//
// A shard stops so when it leaves without a handoff: dropped after a
// suspension, fenced, dropped by the coordinator, or its bind failed.
// Its next holder (the coordinator parking it, or its new owner) has its
// own copy of what arrived here since it subscribed, and answers it once
// handled; only what arrived before that is held here alone. A refusal
// would tell the publisher that nothing was done with a message its next
// owner may handle (a "phantom", as the fault campaign calls it), so no
// answer is sent: a request's outcome is unknown to its sender, who sends
// it again with its key (PROTOCOL.md, What a region cannot vouch for).
func (st *shardState) stop(why string) {
	a := st.a
	st.mu.Lock()
	st.mode = modeGone
	held := 0 // undelivered
	for _, h := range st.held[st.heldNext:] {
		if _, done := st.seen[protocol.MessageKey(h.m.Header, h.m.Reply)]; !done {
			held++
		}
	}
	st.held, st.heldAt, st.seen = nil, nil, nil
	st.mu.Unlock()
	st.cancel()
	st.a.unsubscribeShard(st)
	if held > 0 {
		a.stats.NotOwned.Add(uint64(held))
		a.limit.log(a.log, "held-dropped", "dropped what a shard held, unanswered: it left without a handoff, and its next holder answers its own copies", "shard", st.n, "held", held, "why", why)
	}
}

// forget ends a released shard (its subscription drained): its entities
// were stopped by the handoff.
func (st *shardState) forget() {
	st.mu.Lock()
	st.mode = modeGone
	st.mu.Unlock()
	st.cancel()
}
