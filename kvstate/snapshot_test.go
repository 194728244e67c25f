package kvstate

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard/internal/natstest"
)

// TestListingWhileAReplicaCatchesUp lists the registrations while one of
// the bucket's three replicas catches up after a restart, as the regions
// renew theirs every few milliseconds: the listing's watch lands on that
// replica one time in three (TestSnapshotFromAReplicaBehind has the
// sequence). A region registered while the replica was down must be in
// every listing: a new coordinator that missed it took its shards while
// it served them (docs/FAULTS.md, core seed 50).
func TestListingWhileAReplicaCatchesUp(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-server cluster and restarts a server: not in -short")
	}
	opts := natstest.ClusterOptions(t, 3)
	servers := make([]*server.Server, 3)
	for i, o := range opts {
		servers[i] = natstest.RunServerWithOptions(t, o)
	}
	natstest.WaitMetaLeader(t, servers)
	s := openStore(t, natstest.ClusterURLs(servers), "catchup", Options{Replicas: 3, Timeout: 10 * time.Second})
	ctx := t.Context()

	// A follower of the bucket's stream, not the metadata leader, goes
	// down; the leases are written meanwhile, r2's for the first time.
	stream, err := s.js.Stream(ctx, "KV_"+s.bucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	down := -1
	for i, srv := range servers {
		if srv.Name() != info.Cluster.Leader && !srv.JetStreamIsLeader() {
			down = i
			break
		}
	}
	if down < 0 {
		t.Fatal("no follower that is not the metadata leader")
	}
	const ttl = time.Minute
	ids := []string{"r0", "r1", "r2"}
	leases := map[string]Lease{}
	for _, id := range ids[:2] {
		if leases[id], err = s.RegisterRegion(ctx, regionInfo(id, id+"-1"), ttl); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Shutdown(servers[down])
	// The stream's leadership may move as the server goes: retried
	// through an election.
	natstest.Eventually(t, 30*time.Second, "registering r2", func() (err error) {
		leases["r2"], err = s.RegisterRegion(ctx, regionInfo("r2", "r2-1"), ttl)
		return err
	})
	// Enough writes for the replica's catching up to take a while.
	stored := 0
	for i := range 3000 {
		if _, err := s.SaveEntity(ctx, fmt.Sprintf("e%d", i), []byte("x"), 0); err == nil {
			stored++
		}
	}
	if stored < 2000 {
		t.Fatalf("%d of 3000 writes stored", stored)
	}

	// The regions renew as fast as they can from now on.
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() {
			l := leases[id]
			for rctx.Err() == nil {
				if next, err := s.Renew(rctx, l, regionInfo(id, id+"-1")); err == nil {
					l = next
				}
			}
		})
	}
	defer wg.Wait()
	defer stop()

	// The lister opens its bucket before the server comes back: opening
	// it while that server's JetStream starts timed out once under CI's
	// load (the listings' watches are placed by the servers, whichever
	// server the lister is connected to).
	lister := peer(t, s, "")
	servers[down] = natstest.RunServerWithOptions(t, opts[down])
	deadline := time.Now().Add(5 * time.Second)
	n := 0
	for ; time.Now().Before(deadline); n++ {
		regions, err := lister.Regions(ctx)
		if err != nil {
			t.Logf("listing %d: %v", n, err)
			continue
		}
		var got []string
		for _, r := range regions {
			got = append(got, r.Info.ID)
		}
		if len(got) != len(ids) {
			t.Fatalf("listing %d, %v after the restart: %v, want %v", n, 5*time.Second-time.Until(deadline), got, ids)
		}
	}
	t.Logf("%d listings, each with every region", n)
}
