package bench

import (
	"fmt"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// BenchmarkRegions is the real counterpart of the coordinator's scale
// benchmarks (coordinator.BenchmarkCoreAllocate, BenchmarkCoreRound):
// R regions (echo entities, no traffic) and one coordinator on an embedded
// server, every one on a connection of its own. It measures the first
// allocation (the coordinator starts with every region registered: time
// to every shard active and balanced) and the rebalance when one more
// region joins (its start to balanced again, including the settle window
// of 1 s), and counts on the wire the shard table writes and the commands
// to regions (probes excluded) of each. The last case runs on a
// three-server cluster, the type's bucket and buffer with three replicas.
// Run with
//
//	go test -run '^$' -bench BenchmarkRegions -benchtime 1x ./bench/
func BenchmarkRegions(b *testing.B) {
	type regionsCase struct {
		shards, regions int
		cluster         bool
	}
	cases := []regionsCase{{1024, 10, false}, {1024, 30, false}, {4096, 10, false}, {4096, 30, false}, {4096, 10, true}}
	for _, c := range cases {
		name := fmt.Sprintf("shards=%d/regions=%d", c.shards, c.regions)
		if c.cluster {
			name += "/cluster"
		}
		b.Run(name, func(b *testing.B) {
			for range b.N {
				r := runRegions(b, c.shards, c.regions, c.cluster)
				b.ReportMetric(r.allocate.Seconds(), "allocate-s")
				b.ReportMetric(float64(r.allocWrites), "allocate-kv-writes")
				b.ReportMetric(r.join.Seconds(), "join-s")
				b.ReportMetric(float64(r.joinWrites), "join-kv-writes")
				b.ReportMetric(float64(r.moves), "join-moves")
				b.Log(r)
				report("BenchmarkRegions: " + r.String())
			}
		})
	}
}

type regionsReport struct {
	shards, regions int
	cluster         bool
	allocate        time.Duration // coordinator start -> every shard active, balanced
	allocWrites     int           // shard table writes meanwhile
	allocCommands   int           // commands to regions meanwhile (probes excluded)
	join            time.Duration // one more region started -> balanced again
	joinWrites      int
	joinCommands    int
	moves           int // rows written in state handoff: moves begun
}

func (r regionsReport) String() string {
	on := "one server"
	if r.cluster {
		on = "a 3-server cluster"
	}
	return fmt.Sprintf("%d shards, %d regions on %s: allocation %v (%d table writes, %d commands); one more region: balanced after %v, %d moves (%d table writes, %d commands)",
		r.shards, r.regions, on, r.allocate.Round(time.Millisecond), r.allocWrites, r.allocCommands,
		r.join.Round(time.Millisecond), r.moves, r.joinWrites, r.joinCommands)
}

func runRegions(tb testing.TB, shards, regions int, cluster bool) regionsReport {
	ids := make([]string, regions)
	for i := range ids {
		ids[i] = fmt.Sprintf("r%02d", i)
	}
	s := startSystem(tb, sysConfig{regions: ids, minRegions: regions, plain: true, shards: shards, cluster: cluster})
	defer s.close()
	r := regionsReport{shards: shards, regions: regions, cluster: cluster, allocate: s.allocated}
	r.allocWrites, r.allocCommands, _ = s.tracer.count(s.allocatedAt)

	t0 := now()
	s.startRegion(fmt.Sprintf("r%02d", regions))
	s.waitSettled(time.Minute)
	r.join = now() - t0
	r.joinWrites, r.joinCommands, r.moves = s.tracer.count(t0)
	return r
}

// count returns the shard table writes, the commands to regions and the
// moves begun (rows written in state handoff) that the tracer saw since
// from. (Commands include those resent after Retry ticks unanswered.)
func (t *tracer) count(from time.Duration) (writes, commands, handoffs int) {
	for _, e := range t.since(from) {
		switch e.kind {
		case evWrite:
			writes++
			if e.state == protocol.StateHandoff {
				handoffs++
			}
		case evCommand:
			commands++
		}
	}
	return writes, commands, handoffs
}
