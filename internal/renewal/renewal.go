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

// Wait is how long from now the next renewal is due: Retry (at most a
// quarter of ttl) after a failure; otherwise a quarter of ttl after the
// last successful renewal was sent (renewed), which may be at once when
// that renewal took long to be acknowledged.
func Wait(renewed time.Time, ttl time.Duration, failed bool, now time.Time) time.Duration {
	if failed {
		return min(Retry, ttl/4)
	}
	return max(0, renewed.Add(ttl/4).Sub(now))
}

// Deadline is when a holder whose last successful renewal was sent at
// renewed must have stopped acting if it has not renewed since: 3/4 of ttl
// later. The server counts the TTL from when it stored that renewal, later
// still. A renewal in flight is bounded by the same deadline: into a cut
// network it would otherwise wait past the expiry on the server.
func Deadline(renewed time.Time, ttl time.Duration) time.Time {
	return renewed.Add(ttl * 3 / 4)
}
