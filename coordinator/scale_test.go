package coordinator

import (
	"flag"
	"fmt"
	"log/slog"
	"math"
	"testing"

	"github.com/natshard/natshard/protocol"
)

// How the core's costs grow with shards and regions (issue 14): the pure
// core against simulated regions that answer every command at once (the
// sim, without its invariant checks), so that what is timed is the core's
// decisions and the sim's bookkeeping, no I/O. kv-writes/op counts the
// shard table writes the core asked for (each a fenced KV write in a real
// coordinator), commands/op the commands it sent to regions (each a NATS
// request). Run with
//
//	go test -run '^$' -bench 'BenchmarkCore(Allocate|Round|Tick)' -benchtime 1x ./coordinator/
//
// Cells whose estimated work is above -coordinator.max-work are skipped
// with the estimate (see work).

var flagMaxWork = flag.Float64("coordinator.max-work", 2e10, "skip the scale benchmarks' cells whose estimated inner-loop steps exceed this")

var (
	scaleShards  = []int{1_000, 10_000, 100_000}
	scaleRegions = []int{10, 100, 1_000}
)

// scaleCells runs f for every shards x regions cell, skipping those whose
// work(shards, regions) is above -coordinator.max-work.
func scaleCells(b *testing.B, work func(shards, regions int) float64, f func(b *testing.B, shards, regions int)) {
	for _, shards := range scaleShards {
		for _, regions := range scaleRegions {
			b.Run(fmt.Sprintf("shards=%d/regions=%d", shards, regions), func(b *testing.B) {
				if w := work(shards, regions); w > *flagMaxWork {
					b.Skipf("about %.0e steps, above -coordinator.max-work=%.0e", w, *flagMaxWork)
				}
				f(b, shards, regions)
			})
		}
	}
}

// simRegions returns n regions r0000, r0001, ...
func simRegions(n int) []*simRegion {
	rs := make([]*simRegion, n)
	for i := range rs {
		rs[i] = newSimRegion(fmt.Sprintf("r%04d", i), i+1)
	}
	return rs
}

// balancedSim is a sim whose coordinator took over a table of shards
// active round-robin on regions, each region serving its shards.
func balancedSim(tb testing.TB, cfg CoreConfig, regions []*simRegion) *sim {
	table := make([]protocol.ShardRecord, cfg.Shards)
	for sh := range table {
		r := regions[sh%len(regions)]
		table[sh] = protocol.ShardRecord{Shard: sh, Region: r.id, Incarnation: r.inc, State: protocol.StateActive, Order: uint64(sh + 1), Epoch: 1}
		r.modes[sh] = "live"
	}
	return newSimAt(tb, cfg, table, regions, true)
}

func reportCounts(b *testing.B, s *sim, ops int) {
	b.ReportMetric(float64(s.writes)/float64(ops), "kv-writes/op")
	b.ReportMetric(float64(s.sends)/float64(ops), "commands/op")
}

// BenchmarkCoreAllocate: a coordinator takes over an empty table with
// every region registered, as at the first start of a type: each shard
// is parked, bound to the region the strategy picks (one Bind per region)
// and activated. allocate builds the strategy's view once (one walk of
// the table) and keeps it up to date as it places shards; the strategy
// looks at every region for each shard: about shards x (regions + 30)
// steps. (Before issue 14's change the view was built afresh for every
// shard: shards^2 x (regions + 30).)
func BenchmarkCoreAllocate(b *testing.B) {
	scaleCells(b, func(s, r int) float64 { return float64(s) * float64(r+30) }, func(b *testing.B, shards, regions int) {
		cfg := defaultsConfig(shards)
		cfg.MinRegions = regions
		var s *sim
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			rs := simRegions(regions)
			b.StartTimer()
			s = newSimAt(b, cfg, nil, rs, true)
		}
		if active := countActive(s); active != shards {
			b.Fatalf("%d of %d shards active after the allocation", active, shards)
		}
		reportCounts(b, s, 1)
		slog.Info("allocation", "shards", shards, "regions", regions, "kv_writes", s.writes, "commands", s.sends)
	})
}

// BenchmarkCoreRound: shards balanced on regions-1 regions, one region
// joins; one op is the tick that runs the rebalance round (Settle off):
// the strategy's plan, then every move (HandOff, Bind, Release and their
// answers), at most MaxMoves in flight. The new region gets about
// shards/regions shards. The strategy sees the table once, and the plan
// names each move's target, so a move does not ask it again; the tick
// also probes every region (each answer reconciled against the region's
// own rows): about shards + regions^2 steps, with the strategy's own
// cost per move.
func BenchmarkCoreRound(b *testing.B) {
	scaleCells(b, func(s, r int) float64 { return float64(s) * float64(r) }, func(b *testing.B, shards, regions int) {
		cfg := defaultsConfig(shards)
		cfg.Settle = -1
		cfg.RebalanceEvery = math.MaxInt32 // only the join makes a round due
		var s *sim
		writes, sends, moved := 0, 0, 0
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			s = balancedSim(b, cfg, simRegions(regions-1))
			s.join(fmt.Sprintf("r%04d", regions-1))
			w0, c0 := s.writes, s.sends
			b.StartTimer()
			s.run(s.c.Tick())
			b.StopTimer()
			if len(s.done) != 1 {
				b.Fatalf("rounds done %+v, want one", s.done)
			}
			writes, sends, moved = writes+s.writes-w0, sends+s.sends-c0, moved+s.done[0].Moved
		}
		if c := s.counts(); spread(c) > 1 {
			b.Fatalf("after the round: spread %d", spread(c))
		}
		b.ReportMetric(float64(writes)/float64(b.N), "kv-writes/op")
		b.ReportMetric(float64(sends)/float64(b.N), "commands/op")
		b.ReportMetric(float64(moved)/float64(b.N), "moves/op")
		slog.Info("rebalance round", "shards", shards, "regions", regions, "moves", moved/b.N, "kv_writes", writes/b.N, "commands", sends/b.N)
	})
}

// BenchmarkCoreTick: the standing cost of a balanced coordinator, with the
// default settings: one op is RebalanceEvery ticks (2 s of a real
// coordinator: 20 ticks of 100 ms). Every ProbeEvery ticks each region is
// probed, and each answer is reconciled against the region's own rows;
// at the end a round asks the strategy and finds nothing to move. Each
// answer is an event, and every event looks at each region once
// (moveOffLeaving): about shards + regions^2 steps per probe interval.
// (Before issue 14's change each answer walked the whole table and
// sorted the region IDs: regions x (shards + 10 x regions).)
func BenchmarkCoreTick(b *testing.B) {
	scaleCells(b, func(s, r int) float64 { return float64(s) + float64(r)*float64(r) }, func(b *testing.B, shards, regions int) {
		cfg := defaultsConfig(shards)
		s := balancedSim(b, cfg, simRegions(regions))
		w0, c0 := s.writes, s.sends
		for b.Loop() {
			for range cfg.RebalanceEvery {
				s.run(s.c.Tick())
			}
		}
		s.writes, s.sends = s.writes-w0, s.sends-c0
		reportCounts(b, s, b.N)
	})
}

func countActive(s *sim) int {
	n := 0
	for _, rec := range s.c.Table() {
		if rec.State == protocol.StateActive {
			n++
		}
	}
	return n
}
