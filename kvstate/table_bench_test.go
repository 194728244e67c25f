package kvstate

import (
	"fmt"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// BenchmarkPutShards writes rows of the shard table as one atomic batch
// (PutShards, whatever their number) and one row at a time (PutShard),
// on one server (R1) and a three-server cluster (R3): where a batch
// starts to pay (batchFrom).
//
//	go test -run '^$' -bench PutShards ./kvstate/
func BenchmarkPutShards(b *testing.B) {
	for _, replicas := range []int{1, 3} {
		var url string
		if replicas == 1 {
			url = natstest.URL(natstest.RunServer(b))
		} else {
			url = natstest.ClusterURLs(natstest.RunCluster(b, 3))
		}
		for _, rows := range []int{2, 8, 32, 128, MaxShardBatch} {
			for _, batch := range []bool{true, false} {
				name := fmt.Sprintf("R%d/rows=%d/batch=%v", replicas, rows, batch)
				b.Run(name, func(b *testing.B) {
					s := openStore(b, url, fmt.Sprintf("b%d", typeSeq.Add(1)), Options{Replicas: replicas})
					l, err := s.AcquireCoordinator(b.Context(), coordInfo("a"), time.Minute)
					if err != nil {
						b.Fatal(err)
					}
					recs := make([]protocol.ShardRecord, rows)
					for i := range recs {
						recs[i] = shardRec(i, "r", l.Revision)
					}
					b.ResetTimer()
					for range b.N {
						if batch {
							if err := s.PutShards(b.Context(), l, recs); err != nil {
								b.Fatal(err)
							}
							continue
						}
						for _, rec := range recs {
							if _, err := s.PutShard(b.Context(), l, rec); err != nil {
								b.Fatal(err)
							}
						}
					}
					b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*rows), "µs/row")
				})
			}
		}
	}
}
