package bench

import (
	"context"
	"flag"
	"fmt"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
)

var flagIdleEntities = flag.Int("natshard.idle-entities", 1_000_000, "entities BenchmarkIdleEntities activates in one region")

// idleReport is what BenchmarkIdleEntities measured.
type idleReport struct {
	entities    int
	activate    time.Duration // first publish to the last entity active
	perEntity   float64       // live heap bytes per idle entity
	goroutines  int           // goroutines more than before the first message (0: none per idle entity)
	stop        time.Duration // Agent.Close: every entity stopped
	heapBefore  int64
	heapWithAll int64
}

func (r idleReport) String() string {
	return fmt.Sprintf("%d idle entities in one region: activated in %v (%.0f/s), %.0f B of live heap each (%.1f MiB -> %.1f MiB), %d goroutines more than before; Close stopped them in %v (%.0f ns each)",
		r.entities, r.activate.Round(time.Millisecond), float64(r.entities)/r.activate.Seconds(), r.perEntity,
		float64(r.heapBefore)/(1<<20), float64(r.heapWithAll)/(1<<20), r.goroutines, r.stop.Round(time.Millisecond), float64(r.stop)/float64(r.entities))
}

// BenchmarkIdleEntities measures the memory target (docs/BENCHMARKS.md,
// "Targets"): one region (all 128 shards) of echo entities, as shardd --kind
// echo hosts them, behind a real NATS server. A publisher sends one message to
// each of -natshard.idle-entities distinct entities (flow-controlled: at most
// 50 000 not yet delivered); once every entity is active and idle (every
// message handled, the goroutines that ran them gone), the live heap after a
// GC, less the heap before the first message, divided by the count is
// B/entity: the cell, its map entry, the id, the entity value (zero-size for
// echo), whatever the region keeps per entity. Then Agent.Close stops them all
// (stop-ms), through the same per-entity stop as a passivation (region's
// BenchmarkIdleEntities times the passivation sweep itself, with a fake
// clock). Run with
//
//	go test -run '^$' -bench BenchmarkIdleEntities -benchtime 1x ./bench/
func BenchmarkIdleEntities(b *testing.B) {
	for range b.N {
		r := runIdle(b, *flagIdleEntities)
		b.ReportMetric(r.perEntity, "B/entity")
		b.ReportMetric(float64(r.goroutines), "goroutines")
		b.ReportMetric(r.activate.Seconds(), "activate-s")
		b.ReportMetric(float64(r.entities)/r.activate.Seconds(), "activations/s")
		b.ReportMetric(float64(r.stop)/1e6, "stop-ms")
		b.Log(r)
		report("BenchmarkIdleEntities: " + r.String())
	}
}

func runIdle(tb testing.TB, n int) idleReport {
	s := startSystem(tb, sysConfig{regions: []string{"a"}, minRegions: 1, rebalance: -1, plain: true})
	region := s.region("a")
	pub := s.connect("publisher")
	payload := []byte("idle")
	const window = 50_000
	heapBefore, goroutines := heapAfterGC(), runtime.NumGoroutine()
	delivered := func() int64 { return int64(region.stats().Delivered) }
	t0 := time.Now()
	for i := range n {
		if err := pub.Publish(s.subjects.EntityOf("idle-"+strconv.Itoa(i), shardCount), payload); err != nil {
			tb.Fatal(err)
		}
		for int64(i)-delivered() > window {
			time.Sleep(100 * time.Microsecond)
		}
	}
	natstest.Eventually(tb, 5*time.Minute, "every entity active", func() bool { return region.stats().Entities == n })
	activate := time.Since(t0)
	// Every message handled: the goroutines that ran the entities are gone.
	natstest.Eventually(tb, time.Minute, "the entities' goroutines gone", func() bool { return runtime.NumGoroutine() <= goroutines })
	heap := heapAfterGC()
	// The least of a few counts: the system's own short-lived goroutines
	// (a coordinator's command in flight, a probe's answer) come and go.
	more := runtime.NumGoroutine() - goroutines
	for range 20 {
		time.Sleep(5 * time.Millisecond)
		more = min(more, runtime.NumGoroutine()-goroutines)
	}
	r := idleReport{entities: n, activate: activate, heapBefore: heapBefore, heapWithAll: heap,
		perEntity: float64(heap-heapBefore) / float64(n), goroutines: more}
	if st := region.stats(); st.Malformed+st.NotOwned != 0 {
		tb.Fatalf("%d messages dropped", st.Malformed+st.NotOwned)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	t1 := time.Now()
	if err := region.Node.Close(ctx); err != nil {
		tb.Fatal(err)
	}
	r.stop = time.Since(t1)
	return r
}

// heapAfterGC returns the live heap after full collections.
func heapAfterGC() int64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}
