package region

import "time"

// Stall makes the agent's clock say that it did not run for d: its stall
// watch's last beat moves back by d (stall.go), as if the process had been
// stopped since.
func (a *Agent) Stall(d time.Duration) { a.clock.beat.Add(-int64(d)) }

// ReplayAhead is replayAhead: per entity, the most a replay delivers
// whose buffered copies are not yet purged.
const ReplayAhead = replayAhead
