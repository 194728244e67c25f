package natstest

import (
	"errors"
	"testing"
	"time"
)

// Eventually polls cond until it holds (returns true, or a nil error),
// and fails t once timeout passed without: with what, and the last error
// of a cond that returns one. The poll starts at once and backs off from
// 1 ms to 20 ms between calls.
//
// It is the one wait of natshard's tests: a test waits on a condition,
// never on a clock. timeout bounds a test that would otherwise hang; it
// is no measurement, so make it generous: nothing may depend on the
// condition holding sooner. A test that must see that something does not
// happen waits for a later thing that does (a marker sent after it), then
// checks.
func Eventually[C func() bool | func() error](t testing.TB, timeout time.Duration, what string, cond C) {
	t.Helper()
	var check func() error
	switch c := any(cond).(type) {
	case func() bool:
		check = func() error {
			if c() {
				return nil
			}
			return errNotYet
		}
	case func() error:
		check = c
	}
	deadline := time.Now().Add(timeout)
	for pause := time.Millisecond; ; pause = min(2*pause, 20*time.Millisecond) {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			if err == errNotYet {
				t.Fatalf("%s: not within %v", what, timeout)
			} else {
				t.Fatalf("%s: not within %v: %v", what, timeout, err)
			}
			return
		}
		time.Sleep(pause)
	}
}

// errNotYet is what a bool cond that does not hold stands for.
var errNotYet = errors.New("not yet")
