package renewal

import (
	"testing"
	"time"
)

func TestEvery(t *testing.T) {
	for _, tc := range []struct {
		ttl    time.Duration
		failed bool
		want   time.Duration
	}{
		{4 * time.Second, false, time.Second},
		{4 * time.Second, true, Retry},
		{15 * time.Second, true, Retry},
		{400 * time.Millisecond, true, 100 * time.Millisecond}, // never later than a success would be
	} {
		if got := Every(tc.ttl, tc.failed); got != tc.want {
			t.Errorf("Every(%v, %v) = %v, want %v", tc.ttl, tc.failed, got, tc.want)
		}
	}
}

func TestDeadline(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if got, want := Deadline(at, 4*time.Second), at.Add(3*time.Second); !got.Equal(want) {
		t.Errorf("Deadline = %v, want %v", got, want)
	}
}
