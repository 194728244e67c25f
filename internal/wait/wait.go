// Package wait has the one timed wait natshard's packages share.
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
