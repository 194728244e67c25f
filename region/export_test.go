package region

import (
	"time"

	"github.com/nats-io/nats.go"
)

// Stall makes the agent's clock say that it did not run for d: its stall
// watch's last beat moves back by d (stall.go), as if the process had been
// stopped since.
func (a *Agent) Stall(d time.Duration) { a.clock.beat.Add(-int64(d)) }

// ReplayAhead is replayAhead: per entity, the most keyed messages a
// replay delivers whose buffered copies are not yet purged.
const ReplayAhead = replayAhead

// OnArrival makes hook be called with each message the agent's shard
// subscriptions receive, on their callbacks, before it is routed.
func (a *Agent) OnArrival(hook func(m *nats.Msg)) { a.onArrival.Store(&hook) }
