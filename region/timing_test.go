package region

// Tests of the region's timing (its own timers and clock reads), each in
// a synctest bubble: the time is fake, so a window of seconds passes at
// once and exactly, and each step is checked when every goroutine waits.

import (
	"bytes"
	"context"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"sync"
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
// never before.
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

// TestLogLimiter: a kind of problem is logged at its first occurrence,
// then at most once per logEvery, with the occurrences since its last
// line; kinds are limited apart; goroutines that log at once write one
// line, and no occurrence is lost from the counts.
func TestLogLimiter(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var (
			buf bytes.Buffer // read only while nothing logs
			l   logLimiter
		)
		log := slog.New(slog.NewTextHandler(&buf, nil))
		occurrences := regexp.MustCompile(`msg=(\S+) occurrences=(\d+)`)
		// lines returns the lines logged since the last call, as
		// "kind=occurrences".
		lines := func() []string {
			var got []string
			for _, m := range occurrences.FindAllStringSubmatch(buf.String(), -1) {
				got = append(got, m[1]+"="+m[2])
			}
			buf.Reset()
			return got
		}
		expect := func(when string, want ...string) {
			t.Helper()
			if got := lines(); !slices.Equal(got, want) {
				t.Fatalf("%s: logged %q, want %q", when, got, want)
			}
		}

		l.log(log, "a", "a")
		expect("first occurrence", "a=1")
		l.log(log, "a", "a")
		l.log(log, "b", "b")
		l.log(log, "a", "a")
		expect("within the window", "b=1")
		time.Sleep(logEvery - time.Nanosecond)
		l.log(log, "a", "a")
		expect("just before the window ends")
		time.Sleep(time.Nanosecond)
		l.log(log, "a", "a")
		expect("once the window ended", "a=4")

		// At once from several goroutines: one line, and the next
		// window's line counts the rest.
		time.Sleep(logEvery)
		const goroutines, each = 8, 100
		var wg sync.WaitGroup
		for range goroutines {
			wg.Go(func() {
				for range each {
					l.log(log, "c", "c")
				}
			})
		}
		wg.Wait()
		first := lines()
		if len(first) != 1 {
			t.Fatalf("%d goroutines logging at once wrote %q, want one line", goroutines, first)
		}
		time.Sleep(logEvery)
		l.log(log, "c", "c")
		second := lines()
		if len(second) != 1 {
			t.Fatalf("after the window: %q, want one line", second)
		}
		total := 0
		for _, line := range append(first, second...) {
			n, _ := strconv.Atoi(line[len("c="):])
			total += n
		}
		if total != goroutines*each+1 {
			t.Fatalf("lines %q count %d occurrences, want %d", append(first, second...), total, goroutines*each+1)
		}
	})
}
