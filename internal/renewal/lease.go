// Package renewal is the renewal rule that a region's registration and the
// coordinator's lease share: both are KV keys with a per-key TTL, renewed
// by their holder, who must stop acting before the server can let them
// expire.
package renewal

import "time"

// Retry is how soon a renewal that failed (no stream leader, a timeout) is
// tried again. A JetStream leader election takes seconds; waiting a whole
// renewal interval after each failure would leave one or two tries before
// the holder must give up.
const Retry = 250 * time.Millisecond

// Every is how long after a renewal the next one is due: a quarter of ttl
// after a success, Retry (at most that quarter) after a failure.
func Every(ttl time.Duration, failed bool) time.Duration {
	if failed {
		return min(Retry, ttl/4)
	}
	return ttl / 4
}

// Deadline is when a holder whose last successful renewal was sent at
// renewed must have stopped acting if it has not renewed since: 3/4 of ttl
// later. The server counts the TTL from when it stored that renewal, later
// still. A renewal in flight is bounded by the same deadline: into a cut
// network it would otherwise wait past the expiry on the server.
func Deadline(renewed time.Time, ttl time.Duration) time.Time {
	return renewed.Add(ttl * 3 / 4)
}
