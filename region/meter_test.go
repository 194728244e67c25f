package region

import (
	"math"
	"testing"
	"time"
)

func TestLoadMeter(t *testing.T) {
	var lm loadMeter
	t0 := time.Unix(1000, 0)
	counts := map[int]uint64{1: 100, 2: 0}
	count := func(sh int) uint64 { return counts[sh] }
	rate := func(sh int) (float64, bool) { return lm.rate(sh) }

	lm.sample(t0, []int{1, 2}, count)
	if _, ok := rate(1); ok {
		t.Fatal("measured after one sample")
	}
	counts[1] = 150
	lm.sample(t0.Add(500*time.Millisecond), []int{1, 2}, count) // too early: no sample
	if _, ok := rate(1); ok {
		t.Fatal("sampled within rateEvery")
	}
	counts[1] = 200
	lm.sample(t0.Add(2*time.Second), []int{1, 2, 3}, count)
	if r, ok := rate(1); !ok || r != 50 {
		t.Fatalf("first rate %v %v, want 50 (100 messages in 2 s)", r, ok)
	}
	if r, ok := rate(2); !ok || r != 0 {
		t.Fatalf("idle shard: %v %v", r, ok)
	}
	if _, ok := rate(3); ok {
		t.Fatal("a shard seen once is measured")
	}
	// Then an exponential average: 1 s at 150/s moves the rate by
	// 1-e^(-1/5) of the difference.
	counts[1] = 350
	lm.sample(t0.Add(3*time.Second), []int{1, 2, 3}, count)
	want := 50 + (1-math.Exp(-0.2))*100
	if r, _ := rate(1); math.Abs(r-want) > 1e-9 {
		t.Fatalf("averaged rate %v, want %v", r, want)
	}
	// A counter that went down started afresh (the shard was bound again).
	counts[1] = 10
	lm.sample(t0.Add(4*time.Second), []int{1}, count)
	want += (1 - math.Exp(-0.2)) * (10 - want)
	if r, _ := rate(1); math.Abs(r-want) > 1e-9 {
		t.Fatalf("after a reset %v, want %v", r, want)
	}
	// Shards no longer held are forgotten.
	if _, ok := rate(2); ok {
		t.Fatal("shard 2 is not held any more but kept its rate")
	}
}
