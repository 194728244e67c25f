package bench

import (
	"testing"
	"time"
)

// TestScenarios runs each benchmark's scenario once with tiny sizes, so
// that `go test ./...` exercises the code of the benchmarks. It checks
// that the scenarios complete, never how fast.
func TestScenarios(t *testing.T) {
	if testing.Short() {
		t.Skip("starts NATS servers and regions")
	}
	t.Run("handoff", func(t *testing.T) {
		t.Parallel()
		r := newHandoffRun(t, handoffConfig{shard: handoffShard, entities: 10, rate: 200})
		var samples []handoffSample
		for range 3 {
			r.prepare()
			samples = append(samples, r.moveOnce())
		}
		t.Log(r.describe(summarize(samples), true))
	})
	t.Run("rebalance-dip", func(t *testing.T) {
		t.Parallel()
		cfg := dipConfig{
			entities:  300,
			rate:      200,
			warmup:    200 * time.Millisecond,
			baseline:  500 * time.Millisecond,
			rebalance: 300 * time.Millisecond,
			tail:      200 * time.Millisecond,
			timeout:   20 * time.Second,
		}
		t.Log(runDip(t, cfg).describe(cfg, true))
	})
	for _, cluster := range []bool{false, true} {
		name := "regions"
		if cluster {
			name += "-cluster" // the table written in atomic batches of three replicas
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := runRegions(t, 16, 2, cluster)
			if r.allocWrites < 2*16 || r.moves == 0 {
				t.Errorf("%v: want every shard written at least twice and moves to the new region", r)
			}
			t.Log(r)
		})
	}
	t.Run("durable-shapes", func(t *testing.T) {
		t.Parallel()
		c := shapesCase{entities: 50, window: 100}
		t.Log(shapesTable(c, runShapes(t, c, 1, 200)))
	})
	// Not parallel: it counts the process's goroutines and heap; it runs
	// before the parallel ones resume.
	t.Run("idle-entities", func(t *testing.T) {
		r := runIdle(t, 2000)
		if r.goroutines > 0 {
			t.Errorf("%d goroutines more with 2000 idle entities than without", r.goroutines)
		}
		t.Log(r)
	})
}
