package region

import (
	"time"

	"github.com/natshard/natshard/region/internal/host"
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

// EntityCounts are the entity runtime's counters, since the agent opened.
type EntityCounts = host.Counts

// EntityCounts returns the entity runtime's counters.
func (a *Agent) EntityCounts() EntityCounts { return a.host.Counts() }

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
