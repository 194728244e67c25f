package kvstate

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestConformance runs the conformance suite against a single server with
// an R1 bucket and against a three-server cluster with an R3 bucket. Each
// backend is started once and shared by the suite's parallel subtests, each
// of which works on buckets of its own.
func TestConformance(t *testing.T) {
	t.Run("R1", func(t *testing.T) {
		t.Parallel()
		srv := natstest.RunServer(t)
		testConformance(t, storeFactory(natstest.URL(srv), 1))
	})
	t.Run("R3", func(t *testing.T) {
		t.Parallel()
		servers := natstest.RunCluster(t, 3)
		testConformance(t, storeFactory(natstest.ClusterURLs(servers), 3))
	})
}

var typeSeq atomic.Int64

// storeFactory returns a function opening a Store of a new type, on a
// connection of its own to url.
func storeFactory(url string, replicas int) func(t *testing.T) *Store {
	return func(t *testing.T) *Store {
		t.Helper()
		typ := fmt.Sprintf("t%d", typeSeq.Add(1))
		return openStore(t, url, typ, Options{Replicas: replicas})
	}
}

func openStore(t testing.TB, url, typ string, opts Options) *Store {
	t.Helper()
	nc := natstest.Connect(t, url)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	s, err := Open(ctx, natstest.JetStream(t, nc), typ, opts)
	if err != nil {
		t.Fatalf("Open(%s): %v", typ, err)
	}
	return s
}

// peer opens another Store on s's bucket, with a connection of its own to
// url ("" means the servers s knows).
func peer(t *testing.T, s *Store, url string) *Store {
	t.Helper()
	if url == "" {
		url = strings.Join(s.nc.Servers(), ",")
	}
	return openStore(t, url, strings.TrimPrefix(s.bucket, "natshard_"), s.opts)
}

// testConformance is the suite every backend must pass. newStore opens a
// Store of a type no other test uses.
func testConformance(t *testing.T, newStore func(t *testing.T) *Store) {
	for _, tc := range []struct {
		name string
		fn   func(t *testing.T, newStore func(t *testing.T) *Store)
	}{
		{"Config", testConfig},
		{"ConfigSplit", testConfigSplit},
		{"RememberedEntities", testRememberedEntities},
		{"Daemon", testDaemon},
		{"WorkerClaims", testWorkerClaims},
		{"OpenTwice", testOpenTwice},
		{"CoordinatorAcquire", testCoordinatorAcquire},
		{"CoordinatorRenewAndExpiry", testCoordinatorRenewAndExpiry},
		{"CoordinatorRelease", testCoordinatorRelease},
		{"LostRenewal", testLostRenewal},
		{"CoordinatorDepose", testCoordinatorDepose},
		{"PutShardFenced", testPutShardFenced},
		{"PutShardConcurrent", testPutShardConcurrent},
		{"PutShards", testPutShards},
		{"PutShardsWithoutBatches", testPutShardsWithoutBatches},
		{"Pins", testPins},
		{"ConsistentReads", testConsistentReads},
		{"Registry", testRegistry},
		{"RegistryWatchAndExpiry", testRegistryWatchAndExpiry},
		{"WatchCoordinator", testWatchCoordinator},
		{"Entities", testEntities},
		{"EntityOddIDs", testEntityOddIDs},
		{"ClosedConnection", testClosedConnection},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, newStore)
		})
	}
}

func testConfig(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	if _, err := s.Config(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Config of a new bucket: %v, want ErrNotFound", err)
	}
	got, err := s.EnsureConfig(ctx, protocol.TypeConfig{Shards: 64})
	if err != nil || got.Shards != 64 {
		t.Fatalf("EnsureConfig(64) = %+v, %v", got, err)
	}
	p := peer(t, s, "")
	if got, err := p.EnsureConfig(ctx, protocol.TypeConfig{Shards: 64}); err != nil || got.Shards != 64 {
		t.Fatalf("EnsureConfig(64) again = %+v, %v", got, err)
	}
	got, err = p.EnsureConfig(ctx, protocol.TypeConfig{Shards: 128})
	if !errors.Is(err, ErrConfigMismatch) || got.Shards != 64 {
		t.Fatalf("EnsureConfig(128) over 64 = %+v, %v; want the stored config and ErrConfigMismatch", got, err)
	}
	if !strings.Contains(err.Error(), "64") || !strings.Contains(err.Error(), "128") {
		t.Errorf("mismatch error does not name both values: %v", err)
	}
	if got, err := p.Config(ctx); err != nil || got.Shards != 64 {
		t.Fatalf("Config = %+v, %v", got, err)
	}
	if _, err := s.EnsureConfig(ctx, protocol.TypeConfig{Shards: 0}); err == nil {
		t.Fatal("EnsureConfig(0 shards) succeeded")
	}

	// The entity kind: a process hosting another kind is refused; one
	// that names none, or a bucket that stores none, accepts any.
	k := newStore(t)
	if _, err := k.EnsureConfig(ctx, protocol.TypeConfig{Shards: 8, Kind: "kv"}); err != nil {
		t.Fatal(err)
	}
	got, err = peer(t, k, "").EnsureConfig(ctx, protocol.TypeConfig{Shards: 8, Kind: "echo"})
	if !errors.Is(err, ErrConfigMismatch) || got.Kind != "kv" || !strings.Contains(err.Error(), `"kv"`) || !strings.Contains(err.Error(), `"echo"`) {
		t.Fatalf("EnsureConfig(kind echo) over kv = %+v, %v; want ErrConfigMismatch naming both", got, err)
	}
	if got, err := peer(t, k, "").EnsureConfig(ctx, protocol.TypeConfig{Shards: 8}); err != nil || got.Kind != "kv" {
		t.Fatalf("EnsureConfig(no kind) over kv = %+v, %v", got, err)
	}
	if got, err := p.EnsureConfig(ctx, protocol.TypeConfig{Shards: 64, Kind: "echo"}); err != nil || got.Kind != "" {
		t.Fatalf("EnsureConfig(kind echo) over a config without kind = %+v, %v", got, err)
	}
}

// testConfigSplit: a split's writes of the configuration are fenced on
// the coordinator lease, a watch sees them, and a process configured with
// a count the type had takes the stored configuration.
func testConfigSplit(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	if _, err := s.EnsureConfig(ctx, protocol.TypeConfig{Shards: 8, Kind: "kv"}); err != nil {
		t.Fatal(err)
	}
	w, err := peer(t, s, "").WatchConfig(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c := <-w; c.Shards != 8 {
		t.Fatalf("watch: first %+v", c)
	}
	lease, err := s.AcquireCoordinator(ctx, protocol.CoordinatorInfo{Region: "a", Incarnation: "i1"}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	commit := protocol.TypeConfig{Shards: 8, Kind: "kv", To: 16}
	if _, err := s.PutConfig(ctx, Lease{Key: KeyCoordinator, Revision: lease.Revision + 1}, commit); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutConfig with a stale fence: %v, want ErrFenced", err)
	}
	if _, err := s.PutConfig(ctx, lease, protocol.TypeConfig{Shards: 8, To: 12}); err == nil {
		t.Fatal("PutConfig of counts that are not a layout succeeded")
	}
	if _, err := s.PutConfig(ctx, lease, commit); err != nil {
		t.Fatal(err)
	}
	if c := <-w; c.To != 16 {
		t.Fatalf("watch: after the commit %+v", c)
	}
	// A process started during the split with the old or the new count,
	// or after it with the old one, takes the stored configuration.
	for _, n := range []int{8, 16} {
		if got, err := peer(t, s, "").EnsureConfig(ctx, protocol.TypeConfig{Shards: n}); err != nil || got.To != 16 {
			t.Fatalf("EnsureConfig(%d) during the split = %+v, %v", n, got, err)
		}
	}
	if _, err := s.PutConfig(ctx, lease, protocol.TypeConfig{Shards: 16, Kind: "kv", History: []int{8}}); err != nil {
		t.Fatal(err)
	}
	if c := <-w; c.Shards != 16 || c.To != 0 {
		t.Fatalf("watch: after the announce %+v", c)
	}
	if got, err := peer(t, s, "").EnsureConfig(ctx, protocol.TypeConfig{Shards: 8}); err != nil || got.Shards != 16 {
		t.Fatalf("EnsureConfig(8) after the split = %+v, %v; want the stored 16", got, err)
	}
	_, err = peer(t, s, "").EnsureConfig(ctx, protocol.TypeConfig{Shards: 32})
	if !errors.Is(err, ErrConfigMismatch) || !strings.Contains(err.Error(), "16") || !strings.Contains(err.Error(), "32") {
		t.Fatalf("EnsureConfig(32) over 16 = %v; want ErrConfigMismatch naming both", err)
	}
}

func testOpenTwice(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	p := peer(t, s, "")
	if p.Bucket() != s.Bucket() {
		t.Fatalf("buckets %s and %s", p.Bucket(), s.Bucket())
	}
	st, err := p.kv.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.History() != 1 || st.LimitMarkerTTL() != markerTTL {
		t.Errorf("bucket history %d, limit marker TTL %v", st.History(), st.LimitMarkerTTL())
	}
	if r := st.(*jetstream.KeyValueBucketStatus).StreamInfo().Config.Replicas; r != s.opts.Replicas {
		t.Errorf("bucket has %d replicas, want %d", r, s.opts.Replicas)
	}
	// A bucket with another replica count is bound as it is.
	o := s.opts
	o.Replicas = 1
	if _, err := Open(t.Context(), p.js, strings.TrimPrefix(s.bucket, "natshard_"), o); err != nil {
		t.Errorf("Open with other replicas: %v", err)
	}
	if _, err := Open(t.Context(), p.js, "bad.type", o); err == nil {
		t.Error("Open of an invalid type succeeded")
	}
	// Three processes open a new type's bucket at once (as three shardd
	// started together do): each in its own time, not the store's whole
	// timeout (an update of the stream racing another's once went
	// unanswered on a cluster until the caller gave up).
	typ := fmt.Sprintf("t%d", typeSeq.Add(1))
	servers := strings.Join(s.nc.Servers(), ",")
	ncs := make([]*nats.Conn, 3)
	for i := range ncs {
		ncs[i] = natstest.Connect(t, servers)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(ncs))
	for i, nc := range ncs {
		wg.Go(func() {
			var st *Store
			st, errs[i] = Open(t.Context(), natstest.JetStream(t, nc), typ, Options{Replicas: s.opts.Replicas, Timeout: 3 * time.Second})
			if errs[i] == nil && !st.atomicBatches.Load() {
				errs[i] = errors.New("opened; does not take atomic batches")
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Open %d of three at once: %v", i, err)
		}
	}
}

func coordInfo(region string) protocol.CoordinatorInfo {
	return protocol.CoordinatorInfo{Region: region, Incarnation: region + "-inc", Since: time.Now().UnixMilli()}
}

func testCoordinatorAcquire(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	b := peer(t, a, "")
	ctx := t.Context()
	if _, _, err := b.Coordinator(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Coordinator before any acquisition: %v, want ErrNotFound", err)
	}
	if _, err := a.AcquireCoordinator(ctx, coordInfo("a"), 500*time.Millisecond); err == nil {
		t.Fatal("AcquireCoordinator with a TTL below 1s succeeded")
	}
	la, err := a.AcquireCoordinator(ctx, coordInfo("a"), 1500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if la.Key != KeyCoordinator || la.Revision == 0 || la.TTL != 2*time.Second {
		t.Fatalf("lease %+v; want key %s, a revision, TTL rounded up to 2s", la, KeyCoordinator)
	}
	if _, err := b.AcquireCoordinator(ctx, coordInfo("b"), time.Second); !errors.Is(err, ErrConflict) {
		t.Fatalf("second AcquireCoordinator: %v, want ErrConflict", err)
	}
	info, rev, err := b.Coordinator(ctx)
	if err != nil || info.Region != "a" || rev != la.Revision {
		t.Fatalf("Coordinator = %+v, %d, %v; want a's lease at %d", info, rev, err, la.Revision)
	}
}

func testCoordinatorRenewAndExpiry(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	b := peer(t, a, "")
	ctx := t.Context()
	const ttl = time.Second
	l, err := a.AcquireCoordinator(ctx, coordInfo("a"), ttl)
	if err != nil {
		t.Fatal(err)
	}
	first := l
	// Renew for three TTLs: the lease stays held throughout.
	for end := time.Now().Add(3 * ttl); time.Now().Before(end); {
		time.Sleep(300 * time.Millisecond)
		nl, err := a.Renew(ctx, l, coordInfo("a"))
		if err != nil {
			t.Fatalf("Renew %+v: %v", l, err)
		}
		if nl.Revision <= l.Revision || nl.TTL != ttl || nl.Key != l.Key {
			t.Fatalf("Renew %+v = %+v", l, nl)
		}
		l = nl
	}
	if _, err := b.AcquireCoordinator(ctx, coordInfo("b"), ttl); !errors.Is(err, ErrConflict) {
		t.Fatalf("AcquireCoordinator while renewed: %v, want ErrConflict", err)
	}
	if _, rev, err := b.Coordinator(ctx); err != nil || rev != l.Revision {
		t.Fatalf("Coordinator = %d, %v; want %d", rev, err, l.Revision)
	}
	// A value other than the lease's last (Renew takes a later revision
	// holding exactly its value as its own lost renewal: ownLater), as a
	// renewal made in the same millisecond as the last one could not tell.
	stale := coordInfo("a")
	stale.Since = 1
	if _, err := a.Renew(ctx, first, stale); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew of an outdated revision: %v, want ErrConflict", err)
	}

	// Stop renewing: the lease expires.
	stopped := time.Now()
	natstest.Eventually(t, ttl+3*time.Second, "coordinator lease expiry", func() bool {
		_, _, err := b.Coordinator(ctx)
		return errors.Is(err, ErrNotFound)
	})
	t.Logf("coordinator lease with TTL %v gone %v after the last renewal", ttl, time.Since(stopped).Round(10*time.Millisecond))

	lb, err := b.AcquireCoordinator(ctx, coordInfo("b"), ttl)
	if err != nil {
		t.Fatalf("AcquireCoordinator after expiry: %v", err)
	}
	if _, err := a.Renew(ctx, l, coordInfo("a")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew after expiry and takeover: %v, want ErrConflict", err)
	}
	if _, err := a.PutShard(ctx, l, shardRec(1, "a", l.Revision)); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShard of the expired coordinator: %v, want ErrFenced", err)
	}
	if _, err := b.PutShard(ctx, lb, shardRec(1, "b", lb.Revision)); err != nil {
		t.Fatalf("PutShard of the new coordinator: %v", err)
	}
	if err := b.Release(ctx, lb); err != nil {
		t.Fatal(err)
	}
}

func testCoordinatorRelease(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	b := peer(t, a, "")
	ctx := t.Context()
	la, err := a.AcquireCoordinator(ctx, coordInfo("a"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Release(ctx, la); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := a.Release(ctx, la); !errors.Is(err, ErrConflict) {
		t.Fatalf("second Release: %v, want ErrConflict", err)
	}
	if _, _, err := b.Coordinator(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Coordinator after release: %v, want ErrNotFound", err)
	}
	if _, err := a.PutShard(ctx, la, shardRec(0, "a", la.Revision)); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShard after release: %v, want ErrFenced", err)
	}
	lb, err := b.AcquireCoordinator(ctx, coordInfo("b"), 5*time.Second)
	if err != nil {
		t.Fatalf("AcquireCoordinator after release: %v", err)
	}
	if lb.Revision <= la.Revision {
		t.Fatalf("new epoch %d not after old %d", lb.Revision, la.Revision)
	}
	if _, err := a.Renew(ctx, la, coordInfo("a")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew after release: %v, want ErrConflict", err)
	}
	if _, err := a.PutShard(ctx, la, shardRec(0, "a", la.Revision)); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShard of the old coordinator: %v, want ErrFenced", err)
	}
	if _, err := b.PutShard(ctx, lb, shardRec(0, "b", lb.Revision)); err != nil {
		t.Fatalf("PutShard of the new coordinator: %v", err)
	}
	info, rev, err := a.Coordinator(ctx)
	if err != nil || info.Region != "b" || rev != lb.Revision {
		t.Fatalf("Coordinator = %+v, %d, %v", info, rev, err)
	}
	if err := a.Release(ctx, Lease{}); !errors.Is(err, ErrConflict) {
		t.Fatalf("Release of the zero lease: %v, want ErrConflict", err)
	}
}

// testLostRenewal: a renewal stored after its caller stopped waiting for
// the acknowledgement (here: the answer is dropped, the caller keeps the
// old lease) does not cost the holder its lease; another holder's write
// still does.
func testLostRenewal(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	ctx := t.Context()
	info := coordInfo("a")
	l, err := a.AcquireCoordinator(ctx, info, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	info.Epoch = l.Revision
	l2, err := a.Renew(ctx, l, info)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Renew(ctx, l2, info); err != nil {
		t.Fatal(err)
	}
	// The holder did not learn of the last renewal: it renews from l2.
	l4, err := a.Renew(ctx, l2, info)
	if err != nil {
		t.Fatalf("Renew after a renewal whose acknowledgement was lost: %v", err)
	}
	if _, err := a.PutShard(ctx, l4, shardRec(0, "a", l.Revision)); err != nil {
		t.Fatalf("PutShard with the recovered lease: %v", err)
	}
	// Not the holder's value: the same key, another epoch.
	other := info
	other.Epoch++
	if _, err := a.Renew(ctx, l2, other); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew of another value over a later revision: %v, want ErrConflict", err)
	}
	// Release from the lease before the last renewal it made.
	l5, err := a.Renew(ctx, l4, info)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Renew(ctx, l5, info); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(ctx, l5); err != nil {
		t.Fatalf("Release after a renewal whose acknowledgement was lost: %v", err)
	}
	if _, _, err := a.Coordinator(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Coordinator after release: %v, want ErrNotFound", err)
	}
	if _, err := a.Renew(ctx, l5, info); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew after release: %v, want ErrConflict", err)
	}
}

func testCoordinatorDepose(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	b := peer(t, a, "")
	ctx := t.Context()
	la, err := a.AcquireCoordinator(ctx, coordInfo("a"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.DeposeCoordinator(ctx, la.Revision+1); !errors.Is(err, ErrConflict) {
		t.Fatalf("Depose at a wrong revision: %v, want ErrConflict", err)
	}
	if err := b.DeposeCoordinator(ctx, la.Revision); err != nil {
		t.Fatalf("Depose: %v", err)
	}
	if _, _, err := b.Coordinator(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Coordinator after depose: %v, want ErrNotFound", err)
	}
	if _, err := a.Renew(ctx, la, coordInfo("a")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew after depose: %v, want ErrConflict", err)
	}
	if _, err := a.PutShard(ctx, la, shardRec(3, "a", la.Revision)); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShard after depose: %v, want ErrFenced", err)
	}
	if err := b.DeposeCoordinator(ctx, la.Revision); !errors.Is(err, ErrConflict) {
		t.Fatalf("second Depose: %v, want ErrConflict", err)
	}
}

func shardRec(n int, region string, epoch uint64) protocol.ShardRecord {
	return protocol.ShardRecord{Shard: n, Region: region, Incarnation: region + "-inc", State: protocol.StateActive, Order: uint64(n) + 1, Epoch: epoch}
}

func testPutShardFenced(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	ctx := t.Context()
	if rows, err := a.Shards(ctx); err != nil || len(rows) != 0 {
		t.Fatalf("Shards of a new bucket = %v, %v", rows, err)
	}
	l1, err := a.AcquireCoordinator(ctx, coordInfo("a"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	r5, err := a.PutShard(ctx, l1, shardRec(5, "r1", l1.Revision))
	if err != nil {
		t.Fatalf("PutShard: %v", err)
	}
	if r5 <= l1.Revision {
		t.Fatalf("row revision %d not after the lease's %d", r5, l1.Revision)
	}
	l2, err := a.Renew(ctx, l1, coordInfo("a"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.PutShard(ctx, l1, shardRec(6, "r1", l1.Revision)); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShard with the revision before the renewal: %v, want ErrFenced", err)
	}
	for _, n := range []int{2, 6, 0} {
		if _, err := a.PutShard(ctx, l2, shardRec(n, "r2", l1.Revision)); err != nil {
			t.Fatalf("PutShard(%d) after renewal: %v", n, err)
		}
	}
	rec := shardRec(5, "r2", l1.Revision)
	rec.State = protocol.StateBinding
	if _, err := a.PutShard(ctx, l2, rec); err != nil {
		t.Fatalf("PutShard overwrite: %v", err)
	}
	rows, err := peer(t, a, "").Shards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range rows {
		got = append(got, fmt.Sprintf("%d:%s:%s", r.Shard, r.Region, r.State))
	}
	if want := "0:r2:active 2:r2:active 5:r2:binding 6:r2:active"; strings.Join(got, " ") != want {
		t.Fatalf("Shards = %s, want %s", strings.Join(got, " "), want)
	}
	if _, err := a.PutShard(ctx, Lease{Key: KeyCoordinator}, shardRec(1, "x", 0)); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShard without a lease: %v, want ErrFenced", err)
	}
	if _, err := a.PutShard(ctx, Lease{Key: "regions.x", Revision: l2.Revision}, shardRec(1, "x", 0)); err == nil {
		t.Fatal("PutShard fenced on another key succeeded")
	}
}

// testPutShards writes the table in atomic batches (a bucket Open
// created takes them): a batch lands whole, may write a row twice (the
// last wins), and a fenced one writes nothing.
func testPutShards(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	ctx := t.Context()
	if !a.atomicBatches.Load() {
		t.Fatal("a bucket Open created does not take atomic batches")
	}
	l1, err := a.AcquireCoordinator(ctx, coordInfo("a"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var recs []protocol.ShardRecord
	for n := range MaxShardBatch {
		recs = append(recs, shardRec(n, "r1", l1.Revision))
	}
	again := shardRec(7, "r2", l1.Revision)
	again.State = protocol.StateBinding
	recs[len(recs)-1] = again // the batch's last row, 7 again
	if err := a.PutShards(ctx, l1, recs); err != nil {
		t.Fatalf("PutShards of %d rows: %v", len(recs), err)
	}
	want := map[int]string{}
	for _, r := range recs {
		want[r.Shard] = fmt.Sprintf("%s:%s", r.Region, r.State)
	}
	checkTable(t, peer(t, a, ""), want)

	l2, err := a.Renew(ctx, l1, coordInfo("a"))
	if err != nil {
		t.Fatal(err)
	}
	var stale []protocol.ShardRecord
	for n := range MaxShardBatch {
		stale = append(stale, shardRec(n+1, "x", 0))
	}
	if err := a.PutShards(ctx, l1, stale); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutShards with the revision before the renewal: %v, want ErrFenced", err)
	}
	checkTable(t, a, want)
	if err := a.PutShards(ctx, l2, make([]protocol.ShardRecord, MaxShardBatch+1)); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("PutShards of %d rows: %v, want a refusal", MaxShardBatch+1, err)
	}
	if err := a.PutShards(ctx, l2, []protocol.ShardRecord{shardRec(1, "x", 0), shardRec(-1, "x", 0)}); err == nil {
		t.Fatal("PutShards with shard -1 succeeded")
	}
	checkTable(t, a, want)
	if !a.atomicBatches.Load() {
		t.Fatal("the Store stopped sending batches")
	}
}

// testPutShardsWithoutBatches: on a bucket that takes no atomic batches
// (one made before them, or whose server refuses them) PutShards writes
// none of its rows and says so (ErrBatchRefused: the caller writes them
// one at a time), Batches says no from then on, and Open binds such a
// bucket as it is.
func testPutShardsWithoutBatches(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	ctx := t.Context()
	js := natstest.JetStream(t, a.nc)
	st, err := js.Stream(ctx, "KV_"+a.bucket)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.AllowAtomicPublish = false
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	l, err := a.AcquireCoordinator(ctx, coordInfo("a"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	refused := func(s *Store, from, to int) {
		t.Helper()
		var recs []protocol.ShardRecord
		for n := from; n < to; n++ {
			recs = append(recs, shardRec(n, "r", l.Revision))
		}
		if err := s.PutShards(ctx, l, recs); !errors.Is(err, ErrBatchRefused) {
			t.Fatalf("PutShards of %d rows: %v, want ErrBatchRefused", len(recs), err)
		}
		if s.Batches(len(recs)) {
			t.Fatalf("Batches(%d) says yes on a bucket that takes no batches", len(recs))
		}
		checkTable(t, s, map[int]string{})
	}
	// a believed the bucket took batches; the server refuses the first.
	refused(a, 0, MaxShardBatch)
	// b, opened since, knows it does not.
	refused(peer(t, a, ""), MaxShardBatch, MaxShardBatch+200)
}

// checkTable holds s's shard table to want (shard: "region:state").
func checkTable(t *testing.T, s *Store, want map[int]string) {
	t.Helper()
	rows, err := s.Shards(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	got := map[int]string{}
	for _, r := range rows {
		got[r.Shard] = fmt.Sprintf("%s:%s", r.Region, r.State)
	}
	if !maps.Equal(got, want) {
		t.Fatalf("table has %d rows, want %d; differs from what was written", len(got), len(want))
	}
}

// testPutShardConcurrent writes the table from many goroutines and two
// Store handles at once. A replicated stream refuses a fenced write while
// another write fenced on the same subject is in flight (10164); Store must
// not report that as fencing.
func testPutShardConcurrent(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	b := peer(t, a, "")
	ctx := t.Context()
	l, err := a.AcquireCoordinator(ctx, coordInfo("a"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	const n = 32
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		s := a
		if i%2 == 1 {
			s = b
		}
		wg.Go(func() {
			if _, err := s.PutShard(ctx, l, shardRec(i, "r", l.Revision)); err != nil {
				errs <- fmt.Errorf("PutShard(%d): %w", i, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	rows, err := a.Shards(ctx)
	if err != nil || len(rows) != n {
		t.Fatalf("Shards: %d rows, %v; want %d", len(rows), err, n)
	}
}

// testConsistentReads reads, through every server, what was just written
// through another: reads go to the stream leader, never to a follower that
// has not applied the write yet.
func testConsistentReads(t *testing.T, newStore func(t *testing.T) *Store) {
	w := newStore(t)
	ctx := t.Context()
	var readers []*Store
	for _, url := range w.nc.Servers() {
		readers = append(readers, peer(t, w, url))
	}
	l, err := w.AcquireCoordinator(ctx, coordInfo("w"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var rev uint64
	for i := range 20 {
		if l, err = w.Renew(ctx, l, coordInfo("w")); err != nil {
			t.Fatal(err)
		}
		if rev, err = w.SaveEntity(ctx, "e", []byte{byte(i)}, rev); err != nil {
			t.Fatal(err)
		}
		for _, r := range readers {
			if _, got, err := r.Coordinator(ctx); err != nil || got != l.Revision {
				t.Fatalf("round %d: Coordinator via %s = %d, %v; want %d", i, r.nc.ConnectedUrl(), got, err, l.Revision)
			}
			if data, got, err := r.LoadEntity(ctx, "e"); err != nil || got != rev || data[0] != byte(i) {
				t.Fatalf("round %d: LoadEntity via %s = %v, %d, %v; want revision %d", i, r.nc.ConnectedUrl(), data, got, err, rev)
			}
		}
	}
	// Listings and the initial values of watches include what was just
	// written, although the watch behind them may run on a follower.
	for i := range 8 {
		if _, err := w.PutShard(ctx, l, shardRec(i, "r", l.Revision)); err != nil {
			t.Fatal(err)
		}
		rl, err := w.RegisterRegion(ctx, regionInfo(fmt.Sprintf("r%d", i), "i"), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range readers {
			if rows, err := r.Shards(ctx); err != nil || len(rows) != i+1 {
				t.Fatalf("round %d: Shards via %s: %d rows, %v; want %d", i, r.nc.ConnectedUrl(), len(rows), err, i+1)
			}
			if rs, err := r.Regions(ctx); err != nil || len(rs) != i+1 {
				t.Fatalf("round %d: Regions via %s: %d, %v; want %d", i, r.nc.ConnectedUrl(), len(rs), err, i+1)
			}
		}
		wctx, cancel := context.WithCancel(ctx)
		ch, err := readers[i%len(readers)].WatchRegions(wctx)
		if err != nil {
			t.Fatal(err)
		}
		var last RegionEvent
		for n := 0; ; n++ {
			ev := recv(t, ch)
			if ev.Synced {
				if n != i+1 || last.Revision != rl.Revision {
					t.Fatalf("round %d: %d initial regions, the last at %d; want %d, the last at %d", i, n, last.Revision, i+1, rl.Revision)
				}
				break
			}
			last = ev
		}
		cancel()
		if rl, err = w.Renew(ctx, rl, regionInfo(fmt.Sprintf("r%d", i), "i")); err != nil {
			t.Fatal(err)
		}
		if err := w.RemoveRegion(ctx, fmt.Sprintf("r%d", i), rl.Revision); err != nil {
			t.Fatal(err)
		}
		for _, r := range readers {
			if rs, err := r.Regions(ctx); err != nil || len(rs) != i {
				t.Fatalf("round %d: Regions via %s after removal: %d, %v; want %d", i, r.nc.ConnectedUrl(), len(rs), err, i)
			}
		}
		if _, err := w.RegisterRegion(ctx, regionInfo(fmt.Sprintf("r%d", i), "i"), time.Minute); err != nil {
			t.Fatal(err)
		}
	}
}

func regionInfo(id, inc string) protocol.RegionInfo {
	return protocol.RegionInfo{ID: id, Incarnation: inc, Version: "test", Started: time.Now().UnixMilli()}
}

func testRegistry(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	if rs, err := s.Regions(ctx); err != nil || len(rs) != 0 {
		t.Fatalf("Regions of a new bucket = %v, %v", rs, err)
	}
	if _, err := s.RegisterRegion(ctx, regionInfo("bad.id", "x"), time.Minute); err == nil {
		t.Fatal("RegisterRegion with an invalid id succeeded")
	}
	if _, err := s.RegisterRegion(ctx, regionInfo("r1", "x"), 0); err == nil {
		t.Fatal("RegisterRegion without a TTL succeeded")
	}
	l2, err := s.RegisterRegion(ctx, regionInfo("r2", "i1"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	l1, err := s.RegisterRegion(ctx, regionInfo("r1", "i1"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if l1.Key != "regions.r1" || l1.TTL != time.Minute {
		t.Fatalf("lease %+v", l1)
	}
	rs, err := s.Regions(ctx)
	if err != nil || len(rs) != 2 || rs[0].Info.ID != "r1" || rs[1].Info.ID != "r2" || rs[0].Revision != l1.Revision {
		t.Fatalf("Regions = %+v, %v", rs, err)
	}
	// A restarted process takes over its id; the old incarnation loses.
	l1b, err := peer(t, s, "").RegisterRegion(ctx, regionInfo("r1", "i2"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Renew(ctx, l1, regionInfo("r1", "i1")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew of a replaced registration: %v, want ErrConflict", err)
	}
	if l1b, err = s.Renew(ctx, l1b, regionInfo("r1", "i2")); err != nil {
		t.Fatal(err)
	}
	if info, rev, err := s.Region(ctx, "r1"); err != nil || info.Incarnation != "i2" || rev != l1b.Revision {
		t.Fatalf("Region(r1) = %+v at %d, %v; want incarnation i2 at %d", info, rev, err, l1b.Revision)
	}
	if err := s.RemoveRegion(ctx, "r1", l1.Revision); !errors.Is(err, ErrConflict) {
		t.Fatalf("RemoveRegion at an old revision: %v, want ErrConflict", err)
	}
	if err := s.RemoveRegion(ctx, "r1", l1b.Revision); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Renew(ctx, l1b, regionInfo("r1", "i2")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew of a removed registration: %v, want ErrConflict", err)
	}
	if _, _, err := s.Region(ctx, "r1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Region of a removed registration: %v, want ErrNotFound", err)
	}
	rs, err = s.Regions(ctx)
	if err != nil || len(rs) != 1 || rs[0].Info.ID != "r2" || rs[0].Revision != l2.Revision {
		t.Fatalf("Regions after removal = %+v, %v", rs, err)
	}
	if err := s.Release(ctx, l2); err != nil {
		t.Fatal(err)
	}
	if rs, err := s.Regions(ctx); err != nil || len(rs) != 0 {
		t.Fatalf("Regions after release = %+v, %v", rs, err)
	}
}

func testRegistryWatchAndExpiry(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	la, err := s.RegisterRegion(ctx, regionInfo("ra", "i1"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := peer(t, s, "").WatchRegions(wctx)
	if err != nil {
		t.Fatal(err)
	}
	ev := recv(t, ch)
	if ev.ID != "ra" || ev.Info == nil || ev.Info.Incarnation != "i1" || ev.Revision != la.Revision {
		t.Fatalf("initial event %+v", ev)
	}
	if ev := recv(t, ch); !ev.Synced {
		t.Fatalf("event %+v, want Synced", ev)
	}

	const ttl = time.Second
	lb, err := s.RegisterRegion(ctx, regionInfo("rb", "i1"), ttl)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.ID != "rb" || ev.Info == nil || ev.Revision != lb.Revision {
		t.Fatalf("event %+v, want rb's registration", ev)
	}
	if lb, err = s.Renew(ctx, lb, regionInfo("rb", "i1")); err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.ID != "rb" || ev.Info == nil || ev.Revision != lb.Revision {
		t.Fatalf("event %+v, want rb's renewal", ev)
	}
	renewed := time.Now()
	ev = recv(t, ch)
	if ev.ID != "rb" || ev.Info != nil || ev.Revision <= lb.Revision {
		t.Fatalf("event %+v, want rb's expiry", ev)
	}
	t.Logf("registration with TTL %v: expiry seen by a watch %v after the last renewal", ttl, time.Since(renewed).Round(10*time.Millisecond))
	if rs, err := s.Regions(ctx); err != nil || len(rs) != 1 || rs[0].Info.ID != "ra" {
		t.Fatalf("Regions after expiry = %+v, %v", rs, err)
	}
	if _, err := s.Renew(ctx, lb, regionInfo("rb", "i1")); !errors.Is(err, ErrConflict) {
		t.Fatalf("Renew after expiry: %v, want ErrConflict", err)
	}

	if err := s.RemoveRegion(ctx, "ra", la.Revision); err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.ID != "ra" || ev.Info != nil {
		t.Fatalf("event %+v, want ra's removal", ev)
	}

	// A new watch does not report the tombstones as initial values.
	ch2, err := s.WatchRegions(wctx)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch2); !ev.Synced {
		t.Fatalf("first event of a watch over tombstones: %+v, want Synced", ev)
	}

	cancel()
	expectClosed(t, ch)
	expectClosed(t, ch2)
}

func testWatchCoordinator(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.WatchCoordinator(wctx)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); !ev.Synced {
		t.Fatalf("first event %+v, want Synced", ev)
	}
	p := peer(t, s, "")
	l, err := p.AcquireCoordinator(ctx, coordInfo("p"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.Info == nil || ev.Info.Region != "p" || ev.Revision != l.Revision {
		t.Fatalf("event %+v, want p's lease at %d", ev, l.Revision)
	}
	if l, err = p.Renew(ctx, l, coordInfo("p")); err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.Info == nil || ev.Revision != l.Revision {
		t.Fatalf("event %+v, want the renewal at %d", ev, l.Revision)
	}
	if err := p.Release(ctx, l); err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.Info != nil || ev.Revision <= l.Revision {
		t.Fatalf("event %+v, want the release", ev)
	}
	l, err = s.AcquireCoordinator(ctx, coordInfo("s"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.Info == nil || ev.Info.Region != "s" {
		t.Fatalf("event %+v, want s's lease", ev)
	}
	if ev := recv(t, ch); ev.Info != nil || ev.Revision <= l.Revision {
		t.Fatalf("event %+v, want the expiry", ev)
	}

	// A watch of a held lease starts with it.
	l, err = s.AcquireCoordinator(ctx, coordInfo("s2"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch); ev.Info == nil || ev.Info.Region != "s2" {
		t.Fatalf("event %+v, want s2's lease", ev)
	}
	ch2, err := p.WatchCoordinator(wctx)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recv(t, ch2); ev.Info == nil || ev.Info.Region != "s2" || ev.Revision != l.Revision {
		t.Fatalf("initial event %+v, want s2's lease", ev)
	}
	if ev := recv(t, ch2); !ev.Synced {
		t.Fatalf("event %+v, want Synced", ev)
	}
	cancel()
	expectClosed(t, ch)
	expectClosed(t, ch2)
}

func testEntities(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	p := peer(t, s, "")
	ctx := t.Context()
	const id = "order-42"
	if _, _, err := s.LoadEntity(ctx, id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("LoadEntity of nothing: %v, want ErrNotFound", err)
	}
	r1, err := s.SaveEntity(ctx, id, []byte("one"), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.SaveEntity(ctx, id, []byte("other"), 0); !errors.Is(err, ErrConflict) {
		t.Fatalf("second create: %v, want ErrConflict", err)
	}
	r2, err := s.SaveEntity(ctx, id, []byte("two"), r1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.SaveEntity(ctx, id, []byte("stale"), r1); !errors.Is(err, ErrConflict) {
		t.Fatalf("save at a stale revision: %v, want ErrConflict", err)
	}
	data, rev, err := p.LoadEntity(ctx, id)
	if err != nil || string(data) != "two" || rev != r2 {
		t.Fatalf("LoadEntity = %q, %d, %v; want two at %d", data, rev, err, r2)
	}
	// The applied message's sequence is saved with the state, in the
	// same compare-and-set, and read back with it.
	applied, err := s.SaveEntitySeq(ctx, id, []byte("three"), r2, 1234)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.SaveEntitySeq(ctx, id, []byte("stale"), r2, 1235); !errors.Is(err, ErrConflict) {
		t.Fatalf("SaveEntitySeq at a stale revision: %v, want ErrConflict", err)
	}
	if data, rev, seq, err := p.LoadEntitySeq(ctx, id); err != nil || string(data) != "three" || rev != applied || seq != 1234 {
		t.Fatalf("LoadEntitySeq = %q, %d, %d, %v; want three at %d, applied 1234", data, rev, seq, err, applied)
	}
	// So are the kept answers (region.Answers' encoding, opaque here).
	answers := `[{"key":"op-1","data":"eyJvayI6dHJ1ZX0="}]`
	applied, err = s.SaveEntityState(ctx, id, EntityState{Data: []byte("four"), Rev: applied, Seq: 1240, Answers: answers})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := p.LoadEntityState(ctx, id); err != nil || string(st.Data) != "four" || st.Rev != applied || st.Seq != 1240 || st.Answers != answers {
		t.Fatalf("LoadEntityState = %+v, %v; want four at %d, applied 1240, with its answers", st, err, applied)
	}
	if _, err := s.SaveEntityState(ctx, id, EntityState{Data: []byte("x"), Rev: applied, Answers: "a\nb"}); !errors.Is(err, ErrMalformed) {
		t.Fatalf("answers with a line break: %v, want ErrMalformed", err)
	}
	if _, err := s.SaveEntity(ctx, id, []byte("two"), applied); err != nil {
		t.Fatal(err)
	}
	if st, err := p.LoadEntityState(ctx, id); err != nil || st.Answers != "" {
		t.Fatalf("LoadEntityState after a SaveEntity = %+v, %v; want no answers", st, err)
	}
	if _, rev, seq, err := p.LoadEntitySeq(ctx, id); err != nil || seq != 0 {
		t.Fatalf("LoadEntitySeq after a SaveEntity = %d, %v; want no applied sequence", seq, err)
	} else {
		r2 = rev
	}
	if err := p.DeleteEntity(ctx, id, r1); !errors.Is(err, ErrConflict) {
		t.Fatalf("delete at a stale revision: %v, want ErrConflict", err)
	}
	if err := p.DeleteEntity(ctx, id, 0); !errors.Is(err, ErrConflict) {
		t.Fatalf("delete at revision 0 of an entity with state: %v, want ErrConflict", err)
	}
	if err := p.DeleteEntity(ctx, id, r2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.LoadEntity(ctx, id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("LoadEntity after delete: %v, want ErrNotFound", err)
	}
	if err := p.DeleteEntity(ctx, id, 0); err != nil {
		t.Fatalf("delete at revision 0 of an entity without state: %v", err)
	}
	if _, err := s.SaveEntity(ctx, id, []byte("stale"), r2); !errors.Is(err, ErrConflict) {
		t.Fatalf("save over a deletion at the old revision: %v, want ErrConflict", err)
	}
	r3, err := s.SaveEntity(ctx, id, []byte("three"), 0)
	if err != nil {
		t.Fatalf("create after delete: %v", err)
	}
	if data, rev, err := p.LoadEntity(ctx, id); err != nil || string(data) != "three" || rev != r3 {
		t.Fatalf("LoadEntity = %q, %d, %v; want three at %d", data, rev, err, r3)
	}
	// Empty state is state.
	r4, err := s.SaveEntity(ctx, id, nil, r3)
	if err != nil {
		t.Fatal(err)
	}
	if data, rev, err := p.LoadEntity(ctx, id); err != nil || len(data) != 0 || rev != r4 {
		t.Fatalf("LoadEntity of empty state = %q, %d, %v", data, rev, err)
	}
	for _, bad := range []string{"", ".a", "a.", "a..b", "a b", "a*b", "a>b"} {
		if _, err := s.SaveEntity(ctx, bad, nil, 0); !errors.Is(err, protocol.ErrInvalidEntityID) {
			t.Errorf("SaveEntity(%q): %v, want ErrInvalidEntityID", bad, err)
		}
	}
}

func testEntityOddIDs(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	ids := []string{"a=b", "a=3Db", "x:y", "ü", "user.7", "_x/y-z", "$sys", "a%b", "日本", "#1", "a\\b", "~!@&()"}
	revs := map[string]uint64{}
	for _, id := range ids {
		rev, err := s.SaveEntity(ctx, id, []byte(id), 0)
		if err != nil {
			t.Fatalf("SaveEntity(%q) (key %s): %v", id, EntityKey(id), err)
		}
		revs[id] = rev
	}
	for _, id := range ids {
		data, rev, err := s.LoadEntity(ctx, id)
		if err != nil || string(data) != id || rev != revs[id] {
			t.Errorf("LoadEntity(%q) = %q, %d, %v", id, data, rev, err)
		}
	}
}

// testRememberedEntities: recorded entities are listed per shard, odd ids
// included, a forgotten one no more (and again once recorded again), and a
// peer's listing right after the writes has them all.
func testRememberedEntities(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	ids := []string{"a", "a=b", "user.7", "日本", "~!@&()"}
	var recs []EntityRecord
	for _, id := range ids {
		recs = append(recs, EntityRecord{Shard: 3, ID: id})
	}
	recs = append(recs, EntityRecord{Shard: 4, ID: "other"}, EntityRecord{Shard: 3, ID: "a", Forget: true},
		EntityRecord{Shard: 3, ID: "gone"}, EntityRecord{Shard: 3, ID: "gone", Forget: true},
		EntityRecord{Shard: 3, ID: "back", Forget: true}, EntityRecord{Shard: 3, ID: "back"})
	if err := s.RecordEntities(ctx, recs); err != nil {
		t.Fatal(err)
	}
	got, err := peer(t, s, "").RememberedEntities(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"a=b", "back", "user.7", "~!@&()", "日本"}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("shard 3 remembers %q, want %q", got, want)
	}
	if got, err := s.RememberedEntities(ctx, 4); err != nil || !slices.Equal(got, []string{"other"}) {
		t.Errorf("shard 4 remembers %q, %v", got, err)
	}
	if got, err := s.RememberedEntities(ctx, 5); err != nil || len(got) != 0 {
		t.Errorf("shard 5 remembers %q, %v", got, err)
	}
	if err := s.RecordEntities(ctx, []EntityRecord{{Shard: 3, ID: "bad id"}}); err == nil {
		t.Error("an invalid id was recorded")
	}
}

// testClosedConnection: every operation on a closed connection fails with
// ErrUnavailable, and watches end.
func testClosedConnection(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	l, err := s.AcquireCoordinator(ctx, coordInfo("s"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	rl, err := s.RegisterRegion(ctx, regionInfo("r", "i"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	wch, err := s.WatchRegions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cch, err := s.WatchCoordinator(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s.nc.Close()
	expectClosed(t, wch)
	expectClosed(t, cch)

	ops := map[string]func() error{
		"Open": func() error {
			_, err := Open(ctx, s.js, "closed", Options{})
			return err
		},
		"EnsureConfig": func() error {
			_, err := s.EnsureConfig(ctx, protocol.TypeConfig{Shards: 8})
			return err
		},
		"Config": func() error { _, err := s.Config(ctx); return err },
		"AcquireCoordinator": func() error {
			_, err := s.AcquireCoordinator(ctx, coordInfo("s"), time.Second)
			return err
		},
		"Coordinator":       func() error { _, _, err := s.Coordinator(ctx); return err },
		"DeposeCoordinator": func() error { return s.DeposeCoordinator(ctx, l.Revision) },
		"WatchCoordinator":  func() error { _, err := s.WatchCoordinator(ctx); return err },
		"Renew":             func() error { _, err := s.Renew(ctx, l, coordInfo("s")); return err },
		"Release":           func() error { return s.Release(ctx, l) },
		"RegisterRegion": func() error {
			_, err := s.RegisterRegion(ctx, regionInfo("r", "i"), time.Second)
			return err
		},
		"Regions":      func() error { _, err := s.Regions(ctx); return err },
		"RemoveRegion": func() error { return s.RemoveRegion(ctx, "r", rl.Revision) },
		"WatchRegions": func() error { _, err := s.WatchRegions(ctx); return err },
		"PutShard":     func() error { _, err := s.PutShard(ctx, l, shardRec(0, "r", l.Revision)); return err },
		"Shards":       func() error { _, err := s.Shards(ctx); return err },
		"LoadEntity":   func() error { _, _, err := s.LoadEntity(ctx, "e"); return err },
		"SaveEntity":   func() error { _, err := s.SaveEntity(ctx, "e", nil, 0); return err },
		"DeleteEntity": func() error { return s.DeleteEntity(ctx, "e", 1) },
	}
	for name, op := range ops {
		start := time.Now()
		err := op()
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s on a closed connection: %v, want ErrUnavailable", name, err)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("%s on a closed connection took %v", name, d)
		}
	}
}

// recv receives the next event of ch, failing the test if none comes within
// a few seconds (TTL expiry included) or ch closes.
func recv[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v, ok := <-ch:
		if !ok {
			t.Fatal("watch channel closed")
		}
		return v
	case <-time.After(5 * time.Second):
		t.Fatal("no watch event within 5s")
	}
	panic("unreachable")
}

// expectClosed fails the test unless ch closes soon; events still buffered
// are skipped.
func expectClosed[T any](t *testing.T, ch <-chan T) {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-timeout:
			t.Fatal("watch channel still open 5s after its end")
		}
	}
}
