package natstest_test

import (
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/natshard/natshard/internal/natstest"
)

// fakeT records what Eventually reports instead of ending the test.
type fakeT struct {
	testing.TB
	failed string
}

func (f *fakeT) Helper() {}

func (f *fakeT) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

// TestEventually, in fake time: a condition that comes to hold ends the
// wait as soon as it holds, whichever of the two kinds it is; one that
// never holds fails once the timeout passed (not before), saying what
// was waited for and, for an error condition, its last error.
func TestEventually(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		calls := 0
		f := &fakeT{TB: t}
		natstest.Eventually(f, time.Minute, "three calls", func() bool { calls++; return calls == 3 })
		if f.failed != "" || calls != 3 || time.Since(start) != 3*time.Millisecond {
			t.Fatalf("bool: failed %q after %d calls and %v; want none after 3 calls and 3ms (pauses of 1 and 2)", f.failed, calls, time.Since(start))
		}

		calls = 0
		natstest.Eventually(f, time.Minute, "three calls", func() error {
			if calls++; calls < 3 {
				return errors.New("early")
			}
			return nil
		})
		if f.failed != "" || calls != 3 {
			t.Fatalf("error: failed %q after %d calls; want none after 3 calls", f.failed, calls)
		}

		start = time.Now()
		natstest.Eventually(f, time.Minute, "the impossible", func() bool { return false })
		if f.failed != "the impossible: not within 1m0s" || time.Since(start) < time.Minute {
			t.Fatalf("failed %q after %v; want the impossible not within 1m0s, after a minute", f.failed, time.Since(start))
		}

		f.failed = ""
		n := 0
		natstest.Eventually(f, time.Minute, "the impossible", func() error { n++; return fmt.Errorf("attempt %d", n) })
		if want := fmt.Sprintf("the impossible: not within 1m0s: attempt %d", n); f.failed != want {
			t.Fatalf("failed %q; want %q", f.failed, want)
		}
	})
}
