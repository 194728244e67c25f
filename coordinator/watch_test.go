package coordinator

import (
	"context"
	"log/slog"
	"testing"
	"time"
)

// TestWatchRegionsEndsWithItsContext: a leader whose context ended before
// its region watch began closes the watch's channel (its goroutine once
// blocked for ever on the nil channel of a watch never made: a leak that
// the sidecar's leak test caught after Node.Close).
func TestWatchRegionsEndsWithItsContext(t *testing.T) {
	l := &leader{Node: New(Config{Logger: slog.New(slog.DiscardHandler)})}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	select {
	case _, ok := <-l.watchRegions(ctx):
		if ok {
			t.Fatal("an event from a watch that never began")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watch's channel is still open 10 s after its context ended")
	}
}
