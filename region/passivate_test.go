package region

import (
	"context"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/region/internal/host"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// TestPassivationLoop: the region's passivation loop brings its entities
// down to MaxActive within limitEvery, and passivates an idle entity once
// it has been idle for IdleTimeout, within one sweep (IdleTimeout/10),
// never before. In a synctest bubble: the time is fake, each step is
// checked when every goroutine waits.
func TestPassivationLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const (
			idle      = 10 * time.Second
			sweep     = idle / 10
			maxActive = 5
		)
		a := &Agent{log: slog.New(slog.DiscardHandler)}
		a.host = host.New(host.Config{Factory: benchFactory, Logger: a.log, IdleTimeout: idle, MaxActive: maxActive})
		ctx, cancel := context.WithCancel(context.Background())
		a.wg.Add(1)
		go a.passivationLoop(ctx)
		active := func(when string, want int) {
			t.Helper()
			synctest.Wait()
			if got := a.host.Active(); got != want {
				t.Fatalf("%s: %d entities active, want %d", when, got, want)
			}
		}

		ids, shards := hosttest.IDs(2 * maxActive)
		for i, id := range ids {
			a.host.Deliver(shards[i], id, &nats.Msg{Subject: "x"})
		}
		active("handled", len(ids))
		time.Sleep(limitEvery)
		active("after a check of the limit", maxActive)
		time.Sleep(idle - limitEvery - time.Millisecond)
		active("just before the idle timeout", maxActive)
		time.Sleep(sweep + time.Millisecond)
		active("a sweep after the idle timeout", 0)
		cancel()
		a.wg.Wait()
	})
}
