package bench

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/protocol"
)

// BenchmarkRebalanceDip measures what a rebalance costs the traffic: three
// regions serve 10 000 entities spread over all 128 shards while a
// publisher sends to them round-robin at a fixed rate (-natshard.dip-rate,
// flow-controlled); the handled messages are counted per 100 ms window.
// After a baseline, a fourth region joins and the coordinator's rebalance
// rounds (interval 1 s, default strategy) move shards to it until every
// shard is active and the regions are balanced within one shard.
//
// Reported: baseline-msgs/s, min-msgs/s (the lowest window that starts
// between the join and the settling) and min-window-published-msgs/s (what the publisher sent
// in that window: when it is low too, the machine starved the publisher),
// min/baseline, baseline-min/baseline (the lowest window
// of the baseline itself: the noise floor), settle-s (join to the last
// shard recorded active), rounds and moves. One iteration is a whole
// scenario; run it with -benchtime 1x (more iterations report medians).
func BenchmarkRebalanceDip(b *testing.B) {
	cfg := dipConfig{
		entities:  10_000,
		rate:      *flagDipRate,
		warmup:    2 * time.Second,
		baseline:  5 * time.Second,
		rebalance: time.Second,
		tail:      time.Second,
		timeout:   2 * time.Minute,
	}
	var results []dipResult
	for b.Loop() {
		results = append(results, runDip(b, cfg))
	}
	med := func(f func(r dipResult) float64) float64 {
		v := make([]float64, len(results))
		for i, r := range results {
			v[i] = f(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(med(func(r dipResult) float64 { return r.baseline }), "baseline-msgs/s")
	b.ReportMetric(med(func(r dipResult) float64 { return r.min }), "min-msgs/s")
	b.ReportMetric(med(func(r dipResult) float64 { return r.minSent }), "min-window-published-msgs/s")
	b.ReportMetric(med(func(r dipResult) float64 { return r.min / r.baseline }), "min/baseline")
	b.ReportMetric(med(func(r dipResult) float64 { return r.baselineMin / r.baseline }), "baseline-min/baseline")
	b.ReportMetric(med(func(r dipResult) float64 { return r.settle.Seconds() }), "settle-s")
	b.ReportMetric(med(func(r dipResult) float64 { return benchlab.Millis(r.delay) }), "delay-max-ms")
	b.ReportMetric(med(func(r dipResult) float64 { return float64(r.rounds) }), "rounds")
	b.ReportMetric(med(func(r dipResult) float64 { return float64(r.moves) }), "moves")
	for _, r := range results {
		b.Log(strings.TrimSuffix(r.describe(cfg, false), "\n"))
		report(r.describe(cfg, true))
	}
}

type dipConfig struct {
	entities  int
	rate      float64       // of the publisher, messages/s
	warmup    time.Duration // publisher running before the baseline
	baseline  time.Duration
	rebalance time.Duration // the coordinator's RebalanceInterval
	tail      time.Duration // measured after settling
	timeout   time.Duration // for settling
}

type dipResult struct {
	baseline    float64 // handled messages/s before the join
	baselineMin float64 // the lowest window of the baseline, messages/s
	min         float64 // the lowest window starting from the join until settled, messages/s
	minSent     float64 // what the publisher sent in that window, messages/s
	minAt       time.Duration
	settle      time.Duration // join -> last shard recorded active
	balanced    bool          // settled with a spread <= 1 (else: rounds stopped moving)
	spread      [2]int        // shards per region, least and most, when settled
	rounds      int
	moves       int
	move        stat          // one shard's move during the rebalance: row handoff -> row active
	baseDelay   time.Duration // the longest publish -> Handle delay of a message during the baseline
	delay       time.Duration // the same from the join until the tail after settling
	windows     []window
	join        time.Duration
	stalled     int64
	sent        int64
}

// window is the handled and published counts over one sampling period.
type window struct {
	from, to      time.Duration
	handled, sent int64
}

func (w window) rate() float64     { return float64(w.handled) / (w.to - w.from).Seconds() }
func (w window) sentRate() float64 { return float64(w.sent) / (w.to - w.from).Seconds() }

func runDip(tb testing.TB, cfg dipConfig) dipResult {
	tb.Helper()
	sys := startSystem(tb, sysConfig{regions: []string{"a", "b", "c"}, minRegions: 3, rebalance: cfg.rebalance})
	defer sys.close()
	ids := idsAll(cfg.entities)
	if err := sys.touch(sys.connect("client"), ids); err != nil {
		tb.Fatal(err)
	}
	subjects := make([]string, len(ids))
	for i, id := range ids {
		subjects[i] = sys.subjects.EntityOf(id, shardCount)
	}
	pub := startPublisher(sys.connect("publisher"), subjects, cfg.rate, max(100, int64(cfg.rate/2)), sys.handled)
	sys.onClose(pub.close)

	// Sample the handled count every 100 ms.
	var (
		mu      sync.Mutex
		windows []window
	)
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		at, h, n := now(), sys.handled(), pub.sent.Load()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			at2, h2, n2 := now(), sys.handled(), pub.sent.Load()
			mu.Lock()
			windows = append(windows, window{from: at, to: at2, handled: h2 - h, sent: n2 - n})
			mu.Unlock()
			at, h, n = at2, h2, n2
		}
	}()

	time.Sleep(cfg.warmup)
	baseFrom := now()
	sys.resetDelays()
	time.Sleep(cfg.baseline)
	res := dipResult{join: now()}
	res.baseDelay = sys.maxDelay()
	sys.resetDelays()
	sys.startRegion("d")

	// Settled: every shard active on four regions within one shard of
	// each other; or the rounds stopped moving shards (the strategy's
	// limits) for five intervals.
	handoffs := func(e *event) bool { return e.kind == evWrite && e.state == protocol.StateHandoff }
	deadline := time.Now().Add(cfg.timeout)
	for {
		time.Sleep(100 * time.Millisecond)
		st, err := sys.Status()
		if err == nil && len(st.Regions) == 4 {
			all, lo, hi := spread(st)
			quiet := now() - res.join
			if last := lastEvent(sys.tracer.since(res.join), handoffs); last >= 0 {
				quiet = now() - last
			}
			if all && (hi-lo <= 1 || quiet > 5*cfg.rebalance) {
				res.balanced, res.spread = hi-lo <= 1, [2]int{lo, hi}
				break
			}
		}
		if time.Now().After(deadline) {
			st, _ := sys.Status()
			_, lo, hi := spread(st)
			tb.Fatalf("rebalance not settled %v after the join: spread %d..%d", cfg.timeout, lo, hi)
		}
	}
	time.Sleep(cfg.tail)
	res.delay = sys.maxDelay()
	close(stop)
	<-sampled
	pub.close()
	res.stalled, res.sent = pub.stalled.Load(), pub.sent.Load()

	// The moves, their rounds, and when the last one ended.
	events := sys.tracer.since(res.join)
	var starts []time.Duration
	var moveTimes []time.Duration
	settledAt := res.join
	for i, e := range events {
		if e.kind != evWrite {
			continue
		}
		switch e.state {
		case protocol.StateHandoff:
			starts = append(starts, e.at)
			for _, f := range events[i+1:] {
				if f.kind == evWrite && f.about(e.shards[0]) && f.state == protocol.StateActive {
					moveTimes = append(moveTimes, f.at-e.at)
					break
				}
			}
		case protocol.StateActive:
			settledAt = max(settledAt, e.at)
		}
	}
	res.moves = len(starts)
	for i, at := range starts {
		if i == 0 || at-starts[i-1] > cfg.rebalance/2 {
			res.rounds++
		}
	}
	res.settle = settledAt - res.join
	res.move = distribution("move", "", moveTimes)

	mu.Lock()
	res.windows = slices.Clone(windows)
	mu.Unlock()
	var baseN int64
	var baseDur time.Duration
	res.baselineMin = -1
	res.min = -1
	for _, w := range res.windows {
		switch {
		case w.from >= baseFrom && w.to <= res.join:
			baseN += w.handled
			baseDur += w.to - w.from
			if res.baselineMin < 0 || w.rate() < res.baselineMin {
				res.baselineMin = w.rate()
			}
		case w.from >= res.join && w.from < settledAt:
			if res.min < 0 || w.rate() < res.min {
				res.min, res.minAt, res.minSent = w.rate(), w.from-res.join, w.sentRate()
			}
		}
	}
	if baseDur > 0 {
		res.baseline = float64(baseN) / baseDur.Seconds()
	}
	return res
}

func lastEvent(events []event, match func(e *event) bool) time.Duration {
	for i := len(events) - 1; i >= 0; i-- {
		if match(&events[i]) {
			return events[i].at
		}
	}
	return -1
}

// describe tells the figures of the result; the full form adds the
// windows.
func (r dipResult) describe(cfg dipConfig, full bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d entities on 128 shards, publisher %.0f msg/s (sent %d, window full %d ms), rebalance interval %v\n",
		cfg.entities, cfg.rate, r.sent, r.stalled, cfg.rebalance)
	fmt.Fprintf(&b, "  baseline %.0f msg/s (lowest window %.0f); lowest window after the join %.0f msg/s (%.2f of baseline; %.0f msg/s published) at +%.1fs\n",
		r.baseline, r.baselineMin, r.min, r.min/r.baseline, r.minSent, r.minAt.Seconds())
	how := "balanced"
	if !r.balanced {
		how = "rounds stopped moving"
	}
	fmt.Fprintf(&b, "  settled (%s, %d..%d shards per region) %.2fs after the join: %d moves in %d rounds; one move (row handoff -> row active) p50 %.0f ms, max %.0f ms\n",
		how, r.spread[0], r.spread[1], r.settle.Seconds(), r.moves, r.rounds, benchlab.Millis(r.move.p50), benchlab.Millis(r.move.max))
	fmt.Fprintf(&b, "  longest publish -> Handle delay of a message: %.1f ms in the baseline, %.1f ms from the join until the end\n",
		benchlab.Millis(r.baseDelay), benchlab.Millis(r.delay))
	if !full {
		return b.String()
	}
	b.WriteString("  handled/published msg/s per 100 ms window from 1 s before the join (| = join):")
	n := 0
	for _, w := range r.windows {
		if w.to < r.join-time.Second || w.from > r.join+r.settle+cfg.tail {
			continue
		}
		if n%10 == 0 {
			b.WriteString("\n   ")
		}
		n++
		if w.from < r.join && w.to >= r.join {
			b.WriteString(" |")
		}
		fmt.Fprintf(&b, " %.0f/%.0f", w.rate(), w.sentRate())
	}
	b.WriteString("\n")
	return b.String()
}
