package renewal

import (
	"testing"
	"time"
)

func TestWait(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 10, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		renewed time.Time
		ttl     time.Duration
		failed  bool
		want    time.Duration
	}{
		{"renewed just now", now, 4 * time.Second, false, time.Second},
		{"renewed a while ago", now.Add(-400 * time.Millisecond), 4 * time.Second, false, 600 * time.Millisecond},
		// The acknowledgement took longer than the interval: at once.
		{"acknowledged late", now.Add(-2 * time.Second), 4 * time.Second, false, 0},
		// A long ttl is renewed every second: a bucket's leader election
		// (up to 9 s) fits before the holder gives up at 3/4 of it.
		{"long ttl", now, 15 * time.Second, false, time.Second},
		{"failed", now.Add(-2 * time.Second), 15 * time.Second, true, Retry},
		{"failed, short ttl", now, 400 * time.Millisecond, true, 100 * time.Millisecond},
	} {
		if got := Wait(tc.renewed, tc.ttl, tc.failed, now); got != tc.want {
			t.Errorf("%s: Wait = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestAttemptDeadline(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name         string
		renewed, now time.Time
		ttl          time.Duration
		want         time.Time
	}{
		{"an eighth of the ttl", at, at, 12 * time.Second, at.Add(1500 * time.Millisecond)},
		{"at most 2 s", at, at, 30 * time.Second, at.Add(2 * time.Second)},
		{"at least a second", at, at, 4 * time.Second, at.Add(time.Second)},
		{"never past the deadline", at, at.Add(10 * time.Second), 15 * time.Second, at.Add(11250 * time.Millisecond)},
	} {
		if got := AttemptDeadline(tc.renewed, tc.now, tc.ttl); !got.Equal(tc.want) {
			t.Errorf("%s: AttemptDeadline = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestDeadline(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if got, want := Deadline(at, 4*time.Second), at.Add(3*time.Second); !got.Equal(want) {
		t.Errorf("Deadline = %v, want %v", got, want)
	}
}
