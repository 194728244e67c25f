package benchlab

import (
	"testing"
	"time"
)

func TestLatHist(t *testing.T) {
	h := &latHist{}
	for i := 1; i <= 1000; i++ {
		h.add(time.Duration(i) * time.Microsecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.9, 900 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, 1000 * time.Microsecond}} {
		got := h.quantile(c.q)
		if got > c.want || float64(got) < 0.96*float64(c.want) {
			t.Errorf("quantile(%v) = %v, want %v less at most 4 %%", c.q, got, c.want)
		}
	}
	for _, ns := range []uint64{0, 1, 31, 32, 33, 63, 64, 1000, 1 << 40, 1<<63 + 5} {
		if v := histValue(histIndex(ns)); uint64(v) > ns || float64(ns-uint64(v)) > 0.04*float64(ns) {
			t.Errorf("bucket of %d starts at %d", ns, v)
		}
	}
}
