package region

import (
	"context"
	"sync/atomic"
	"time"
)

// Zombies (PROTOCOL.md, Zombie regions). A region whose process was not
// scheduled for a while (SIGSTOP, a long GC pause, a VM stall) may have
// lost shards meanwhile: the coordinator forces the reallocation of a
// shard whose handoff timed out (--handoff-timeout, 1 s at the least), and
// removes a region whose subscriptions are gone or whose registration
// expired. Once it runs again, nothing tells it at once: the drop is
// queued behind the messages and commands that arrived meanwhile, and
// those are delivered first. So the region watches its own clock
// (monotonic): a gap of Config.StallLimit or more between two beats of its watch
// is a stall, and it is handled as a lost connection (Agent.Suspend): the
// live shards hold what arrives, shards in a move stop where they are, and the region
// renews its registration, reads the shard table and serves again only
// the shards the table still gives it. The delivery to a live shard
// checks the beat too, so that a message taken from the subscription
// before the watch ran after the stall is held, not handled.
//
// A command checks the clock as it arrives (Agent.onCommand), before the
// core sees it: after a stall, or past the registration deadline, it is
// refused while the region is suspended, and the coordinator sends it
// again. A stale pause is also fenced by the buffer's fence
// (kvstate.Buffer.Fence).

// stallBeat is the period of the stall watch.
const stallBeat = 100 * time.Millisecond

// DefaultStallLimit is Config.StallLimit's default: half the shortest
// handoff timeout the coordinator takes (1 s). natshard sets the type's
// HandOffTimeout/2 (5 s by default), which a loaded machine's scheduling
// delays do not reach.
const DefaultStallLimit = 500 * time.Millisecond

// stallClock is the region's monotonic clock: nanoseconds since base.
type stallClock struct {
	base     time.Time
	limit    int64        // Config.StallLimit; 0: no stall watch
	beat     atomic.Int64 // when the watch last ran
	deadline atomic.Int64 // registration deadline (renewal.Deadline); 0: none
	// flight is the handling of the stall found last (stalled).
	flight atomic.Pointer[stallFlight]
}

// stallFlight is one finder's handling of a stall, known by the beat it
// found stale. The watch, a delivery and each entity's worker may find
// the same stall at once; the first handles it, the others wait for it
// (done) instead of counting it again: the runtime holds a shard for the
// stall count of its suspension, and a message that saw a higher count
// for the same stall was refused (a stress run under -race, 2026-11-29).
type stallFlight struct {
	beat int64
	done chan struct{}
}

func (c *stallClock) now() int64 { return int64(time.Since(c.base)) }

// at is t on the clock.
func (c *stallClock) at(t time.Time) int64 { return int64(t.Sub(c.base)) }

// stalledAt reports the gap since the last beat when it is a stall.
func (c *stallClock) stalledAt(now int64) (time.Duration, bool) {
	gap := now - c.beat.Load()
	return time.Duration(gap), c.limit > 0 && gap >= c.limit
}

// check reads the clock once (not at all without a stall watch) and
// reports, with the time it read, whether the region stalled or passed
// its registration deadline, and the gap since the last beat.
func (c *stallClock) check() (now int64, gap time.Duration, stalled bool) {
	if c.limit == 0 {
		return 0, 0, false
	}
	now = c.now()
	g := now - c.beat.Load()
	d := c.deadline.Load()
	return now, time.Duration(g), g >= c.limit || d != 0 && now >= d
}

// stallWatch beats every stallBeat until ctx ends, and handles a stall.
func (a *Agent) stallWatch(ctx context.Context) {
	defer a.wg.Done()
	if a.clock.limit == 0 {
		return
	}
	t := time.NewTicker(stallBeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := a.clock.now()
		if gap, stalled := a.clock.stalledAt(now); stalled {
			a.stalled(gap, now)
		} else {
			a.clock.beat.Store(now)
		}
	}
}

// stallCount returns the number of stalls the region handled; with check,
// it first looks for one (a stall, or the registration deadline passed)
// and handles it (host.Config.Stalls).
func (a *Agent) stallCount(check bool) uint64 {
	if check {
		if now, gap, stalled := a.clock.check(); stalled {
			a.stalled(gap, now)
		}
	}
	return a.stats.Stalls.Load()
}

// stalled handles a stall of gap, found at now: the region suspends (its
// live shards hold what arrives), then confirms its shards as after a
// reconnect. Only then does the beat move on, so that a delivery that
// sees the old beat has found its shard suspended when it looks again.
func (a *Agent) stalled(gap time.Duration, now int64) {
	f := &stallFlight{beat: now - int64(gap), done: make(chan struct{})}
	for {
		cur := a.clock.flight.Load()
		if cur != nil && cur.beat == f.beat {
			<-cur.done // found by another finder too: handled once
			return
		}
		if a.clock.flight.CompareAndSwap(cur, f) {
			break
		}
	}
	defer close(f.done)
	if v := a.viewNow(); v.registered && !v.closed { // fenced or closing: nothing to suspend
		a.stats.Stalls.Add(1)
		a.limit.log(a.log, "stalled", "the region was not running for a while (stopped, a long GC pause, a VM stall), or its registration deadline passed: it may have lost shards meanwhile; suspending them until it has confirmed them", "gap", gap.Round(time.Millisecond))
		a.Suspend("stalled for " + gap.Round(time.Millisecond).String())
		a.Reconnected()
	}
	for {
		old := a.clock.beat.Load()
		if old >= now || a.clock.beat.CompareAndSwap(old, now) {
			return
		}
	}
}
