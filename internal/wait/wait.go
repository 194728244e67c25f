// Package wait has the timed wait and the retry backoff that natshard's
// packages share.
package wait

import (
	"context"
	"time"
)

// Sleep waits for d or until ctx ends; it reports whether ctx is still
// alive. A d of 0 or less returns at once.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// The backoff between attempts of something that failed and may pass
// when tried again (JetStream electing a stream leader takes seconds):
// RetryFirst, then doubled (Next) up to RetryMax.
const (
	RetryFirst = 100 * time.Millisecond
	RetryMax   = 2 * time.Second
)

// Next is the backoff after d: twice d, at most RetryMax.
func Next(d time.Duration) time.Duration { return min(2*d, RetryMax) }
