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

// Interval is how often a holder renews: a quarter of ttl, at most a
// second. A holder that cannot renew gives up 3/4 of ttl after its last
// renewal (Deadline); when a NATS server is lost, JetStream elects the
// bucket's new leader within 4 to 9 s (nats-server's raft election
// timeout) and nothing can be renewed meanwhile. With a 15 s ttl renewed
// every 3.75 s, a holder could give up 7.5 s after the loss, within the
// election; renewed every second it has at least 10.25 s.
func Interval(ttl time.Duration) time.Duration { return min(ttl/4, time.Second) }

// Wait is how long from now the next renewal is due: Retry (at most
// Interval) after a failure; otherwise Interval after the last successful
// renewal was sent (renewed), which may be at once when that renewal took
// long to be acknowledged.
func Wait(renewed time.Time, ttl time.Duration, failed bool, now time.Time) time.Duration {
	if failed {
		return min(Retry, Interval(ttl))
	}
	return max(0, renewed.Add(Interval(ttl)).Sub(now))
}

// Deadline is when a holder whose last successful renewal was sent at
// renewed must have stopped acting if it has not renewed since: 3/4 of ttl
// later. The server counts the TTL from when it stored that renewal, later
// still. A renewal in flight is bounded by the same deadline: into a cut
// network it would otherwise wait past the expiry on the server.
func Deadline(renewed time.Time, ttl time.Duration) time.Time {
	return renewed.Add(ttl * 3 / 4)
}

// AttemptDeadline bounds one renewal sent at now: at the holder's Deadline,
// and an eighth of ttl (1 to 2 s) after now. A request sent while the
// stream elects a leader may get no answer at all (the cluster test saw
// one wait 8 s, until the deadline, while the same holder's other requests
// got "no response from stream" at once and were retried): a bounded
// attempt is retried Retry later, with the time left, and the renewal
// succeeds soon after the election.
func AttemptDeadline(renewed, now time.Time, ttl time.Duration) time.Time {
	d := Deadline(renewed, ttl)
	if a := now.Add(min(max(ttl/8, time.Second), 2*time.Second)); a.Before(d) {
		return a
	}
	return d
}
