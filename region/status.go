package region

import (
	"slices"
	"time"
)

// What an Agent tells health checks, metrics and traces (package
// natshard serves them). Everything here is read when asked (a scrape, a
// probe of /readyz) or reported on rare paths (a handoff step): the
// message path only increments counters it already held a lock for.

// Status is a snapshot of an Agent.
type Status struct {
	// Registered: the region has a registration (it is not fenced, or
	// registered a new incarnation since).
	Registered bool
	// Leaving: the region is marked leaving (drained, or its process is
	// stopping); Closed: Close was called.
	Leaving, Closed bool
	Incarnation     string
	// Epoch is the newest coordinator epoch whose command the region
	// obeyed (a probe comes every 500 ms); 0 until a coordinator
	// commanded it.
	Epoch uint64
	// Shards held, by mode (Suspended: held while the region confirms
	// them after a reconnect, see Agent.Suspend).
	Replaying, Live, Paused, Suspended int
}

// Status returns the agent's status.
func (a *Agent) Status() Status {
	v := a.viewNow()
	st := Status{
		Registered: v.registered, Leaving: v.leaving, Closed: v.closed,
		Incarnation: v.incarnation, Epoch: v.epoch,
	}
	for _, m := range v.modes {
		switch m {
		case modeHold:
			st.Replaying++
		case modeLive:
			st.Live++
		case modeDivert:
			st.Paused++
		case modeSuspended:
			st.Suspended++
		}
	}
	return st
}

// EntityCounts are the entity host's counters, since the agent opened.
type EntityCounts struct {
	Active       int    // entities held (created, being created or stopped)
	Activations  uint64 // entities created by the Factory
	Passivations uint64 // idle entities stopped (IdleTimeout or MaxActive)
	OverLimit    uint64 // of those, stopped because the region held more than MaxActive
	// Delivered: messages handed to entities (live, replayed or held;
	// not those refused because their shard was being stopped).
	Delivered uint64
	// Handled: messages whose handling ended (Handle returned or
	// panicked, or the entity could not be created); Failed: of those,
	// the ones answered with an error.
	Handled, Failed uint64
	// RefusedStopping: messages refused because their shard's entities
	// were being stopped (the shard was leaving).
	RefusedStopping uint64
}

// EntityCounts returns the entity host's counters.
func (a *Agent) EntityCounts() EntityCounts {
	h := a.host
	c := h.counts()
	return EntityCounts{
		Active: h.active(), Activations: h.activations.Load(), Passivations: h.passivations.Load(), OverLimit: h.overLimit.Load(),
		Delivered: c.delivered, Handled: c.handled, Failed: c.failed, RefusedStopping: h.refusedStopping.Load(),
	}
}

// msgCounts count the messages queued for a shard's entities and those
// they handled; each shard keeps its own under its lock, and the host
// keeps those of the shards it forgot. (A count shared by the shards, an
// atomic, was a cache line that every message moved from core to core.)
type msgCounts struct{ delivered, handled, failed uint64 }

func (c *msgCounts) add(d msgCounts) {
	c.delivered += d.delivered
	c.handled += d.handled
	c.failed += d.failed
}

// counts sums the counts of the shards held and of those forgotten. A
// shard is either held or counted in h.gone (drainedLocked moves it
// under h.mu), and its count only grows, so the sum never goes down
// from one call to the next.
func (h *host) counts() msgCounts {
	h.mu.RLock()
	total, held := h.gone, slices.Collect(h.table.each())
	h.mu.RUnlock()
	for _, se := range held {
		se.mu.Lock()
		total.add(se.counts)
		se.mu.Unlock()
	}
	return total
}

// Step is a handoff step as this region saw it, reported to
// Config.OnStep once it ended.
type Step struct {
	Shard   int
	Handoff uint64 // the handoff id (the move's)
	// Kind is "pause" (from HandOff until the shard's entities stopped:
	// the source's part) or "replay" (from Bind until the shard went
	// live: the buffer replayed up to the end marker, then the held
	// arrivals).
	Kind         string
	Began, Ended time.Time
	Replayed     int // replay: buffered messages delivered
}

// reportPause reports the pause of shard once its entities have stopped
// (stopped closes), unless the agent closes first.
func (a *Agent) reportPause(shard int, handoff uint64, stopped <-chan struct{}) {
	if a.cfg.OnStep == nil {
		return
	}
	began := time.Now()
	go func() {
		select {
		case <-stopped:
			a.cfg.OnStep(Step{Shard: shard, Handoff: handoff, Kind: "pause", Began: began, Ended: time.Now()})
		case <-a.ctx.Done():
		}
	}()
}

// reportReplay reports the replay of shard, begun at began, that has just
// gone live.
func (a *Agent) reportReplay(shard int, handoff uint64, began time.Time, replayed int) {
	if a.cfg.OnStep != nil {
		a.cfg.OnStep(Step{Shard: shard, Handoff: handoff, Kind: "replay", Began: began, Ended: time.Now(), Replayed: replayed})
	}
}
