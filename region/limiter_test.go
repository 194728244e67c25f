package region

import (
	"bytes"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// TestLogLimiter: a kind of problem is logged at its first occurrence,
// then at most once per logEvery, with the occurrences since its last
// line; kinds are limited apart; goroutines that log at once write one
// line, and no occurrence is lost from the counts. In a synctest bubble:
// the time is fake, the windows exact.
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
