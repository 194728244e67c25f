package kvstate_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// smallStore is the JetStream file store limit of the space tests.
const smallStore = 8 << 20

// TestSpace fills a type's bucket with entity state and its buffer with
// messages, on a small store, single server and R3: the leases, the
// registrations, the shard table and the end markers keep being
// written; what is refused gets ErrNoSpace naming the stream and its
// limit; freed space is taken again without reopening anything. And a
// stream whose byte limit does not fit in the store is refused at
// creation (the limits are reservations).
func TestSpace(t *testing.T) {
	small := func(o *server.Options) { o.JetStreamMaxStore = smallStore }
	for _, replicas := range []int{1, 3} {
		t.Run(fmt.Sprintf("R%d", replicas), func(t *testing.T) {
			var url string
			if replicas == 1 {
				opts := natstest.DefaultOptions(t)
				small(opts)
				url = natstest.URL(natstest.RunServerWithOptions(t, opts))
			} else {
				url = natstest.ClusterURLs(natstest.RunClusterWith(t, replicas, small))
			}
			js := natstest.JetStream(t, natstest.Connect(t, url))
			t.Run("Bucket", func(t *testing.T) { testSpaceBucket(t, url, replicas) })
			t.Run("Buffer", func(t *testing.T) { testSpaceBuffer(t, js, replicas) })
			t.Run("Reservation", func(t *testing.T) {
				_, err := kvstate.OpenStream(testCtx(t), js, protocol.MustSubjects("", "", "huge"),
					kvstate.StreamOptions{Replicas: replicas, MaxBytes: 2 * smallStore})
				if !errors.Is(err, kvstate.ErrNoSpace) {
					t.Fatalf("a stream of %d bytes on a store of %d: %v, want ErrNoSpace", 2*smallStore, smallStore, err)
				}
				t.Logf("refused: %v", err)
			})
		})
	}
}

func testSpaceBucket(t *testing.T, url string, replicas int) {
	const maxBytes = 1 << 20 // a reserve of 64 KiB
	logs := &natstest.Buffer{}
	s := openSpaceStore(t, url, "b", kvstate.Options{Replicas: replicas, MaxBytes: maxBytes, Logger: newLogger(logs)})
	ctx := testCtx(t)
	// A lease that outlives the test: one row at a time, 1 000 rows on R3
	// took more than a 4 s TTL in CI under load, and the lease expired
	// (the rows' writes were fenced). What is tested is room, not time.
	coord, err := s.AcquireCoordinator(ctx, protocol.CoordinatorInfo{Region: "r1", Incarnation: "i"}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := s.RegisterRegion(ctx, protocol.RegionInfo{ID: "r1", Incarnation: "i"}, 4*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// The table's rows, as a first allocation writes them: one batch.
	rows := make([]protocol.ShardRecord, kvstate.MaxShardBatch)
	for i := range rows {
		rows[i] = protocol.ShardRecord{Shard: i, Region: "r1", State: protocol.StateBinding}
	}
	if err := s.PutShards(ctx, coord, rows); err != nil {
		t.Fatal(err)
	}
	// Fill the bucket with entity state until a write is refused.
	value := []byte(strings.Repeat("x", 8<<10))
	revs := map[string]uint64{}
	var refused error
	for i := 0; refused == nil; i++ {
		if i > 2*maxBytes/len(value) {
			t.Fatalf("%d entity writes of %d bytes into a bucket of %d bytes, none refused", i, len(value), maxBytes)
		}
		id := fmt.Sprintf("e%d", i)
		rev, err := s.SaveEntity(ctx, id, value, 0)
		if err != nil {
			refused = err
			break
		}
		revs[id] = rev
	}
	if !errors.Is(refused, kvstate.ErrNoSpace) || !errors.Is(refused, kvstate.ErrUnavailable) ||
		!strings.Contains(refused.Error(), "KV_natshard_b") || !strings.Contains(refused.Error(), "kept for leases") {
		t.Fatalf("entity write refused with %v; want ErrNoSpace naming the stream and why", refused)
	}
	t.Logf("%d entities of %d bytes stored, then: %v", len(revs), len(value), refused)
	// The control data is written all the same: renewals, a new
	// registration, shard table writes fenced on the lease.
	for i := range 5 {
		if coord, err = s.Renew(ctx, coord, protocol.CoordinatorInfo{Region: "r1", Incarnation: "i"}); err != nil {
			t.Fatalf("coordinator renewal %d with the bucket full of entity state: %v", i, err)
		}
		if reg, err = s.Renew(ctx, reg, protocol.RegionInfo{ID: "r1", Incarnation: "i"}); err != nil {
			t.Fatalf("registration renewal %d with the bucket full of entity state: %v", i, err)
		}
		if _, err := s.PutShard(ctx, coord, protocol.ShardRecord{Shard: i, Region: "r1", State: protocol.StateActive}); err != nil {
			t.Fatalf("shard table write %d with the bucket full of entity state: %v", i, err)
		}
	}
	if _, err := s.RegisterRegion(ctx, protocol.RegionInfo{ID: "r2", Incarnation: "j"}, 4*time.Second); err != nil {
		t.Fatalf("a new registration with the bucket full of entity state: %v", err)
	}
	// And the rows again, as their activation writes them: the server
	// counts a batch's bytes as added, not as replacing the rows, so near
	// the limit it refuses the batch, none of it written; the rows go one
	// at a time (as the coordinator writes them then).
	for i := range rows {
		rows[i].State = protocol.StateActive
	}
	if err := s.PutShards(ctx, coord, rows); !errors.Is(err, kvstate.ErrBatchRefused) {
		t.Fatalf("%d shard table rows rewritten as one batch with the bucket full of entity state: %v, want ErrBatchRefused", len(rows), err)
	}
	if table, err := s.Shards(ctx); err != nil || table[len(rows)-1].State != protocol.StateBinding {
		t.Fatalf("a refused batch wrote its rows: %v", err)
	}
	for _, rec := range rows {
		if _, err := s.PutShard(ctx, coord, rec); err != nil {
			t.Fatalf("shard table row %d rewritten alone with the bucket full of entity state: %v", rec.Shard, err)
		}
	}
	if table, err := s.Shards(ctx); err != nil || len(table) != len(rows) || table[len(rows)-1].State != protocol.StateActive {
		t.Fatalf("the table after the rows were rewritten: %d rows, %v", len(table), err)
	}
	// A write that adds no bytes passes (it may be what frees space).
	if rev, err := s.SaveEntity(ctx, "e0", []byte("small"), revs["e0"]); err != nil {
		t.Fatalf("a shrinking entity write with the bucket full: %v", err)
	} else {
		revs["e0"] = rev
	}
	if !strings.Contains(logs.String(), "JetStream refused writes for lack of space") || !strings.Contains(logs.String(), "KV_natshard_b") {
		t.Fatalf("no log line about the refusal:\n%s", logs)
	}
	// Space freed: entity writes pass again, without reopening anything.
	for i := 1; i < len(revs)/2; i++ {
		id := fmt.Sprintf("e%d", i)
		if err := s.DeleteEntity(ctx, id, revs[id]); err != nil {
			t.Fatalf("delete %s with the bucket full: %v", id, err)
		}
	}
	natstest.Eventually(t, 10*time.Second, "an entity write after space was freed", func() error {
		_, err := s.SaveEntity(ctx, "new", value, 0)
		if err != nil && !errors.Is(err, kvstate.ErrNoSpace) {
			t.Fatalf("entity write after space was freed: %v", err)
		}
		return err
	})
}

func testSpaceBuffer(t *testing.T, js jetstream.JetStream, replicas int) {
	const maxBytes = 512 << 10 // a reserve of 64 KiB
	subjects := protocol.MustSubjects("", "", "buf")
	logs := &natstest.Buffer{}
	b, err := kvstate.OpenBuffer(testCtx(t), js, subjects, kvstate.BufferOptions{
		Replicas: replicas, MaxBytes: maxBytes, Timeout: 10 * time.Second, Logger: newLogger(logs),
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var failed []error
	failedMsgs := map[string]bool{}
	onFail := func(m *nats.Msg, err error) {
		mu.Lock()
		failed = append(failed, err)
		failedMsgs[string(m.Data)] = true
		mu.Unlock()
	}
	data := strings.Repeat("y", 1<<10)
	const n = 2 * maxBytes / (1 << 10)
	for i := range n {
		b.Append(0, &nats.Msg{Subject: subjects.Entity(0, "e"), Data: fmt.Appendf(nil, "%d %s", i, data)}, onFail)
		if i%64 == 0 {
			if err := b.Flush(testCtx(t)); err != nil { // lets the budget learn the stream's size
				t.Fatal(err)
			}
		}
	}
	if err := b.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	nFailed := len(failed)
	first := error(nil)
	if nFailed > 0 {
		first = failed[0]
	}
	mu.Unlock()
	if nFailed == 0 {
		t.Fatalf("%d appends of 1 KiB into a buffer of %d bytes: none refused", n, maxBytes)
	}
	for _, err := range failed {
		if !errors.Is(err, kvstate.ErrBufferFull) || !errors.Is(err, kvstate.ErrNoSpace) {
			t.Fatalf("append refused with %v; want ErrBufferFull and ErrNoSpace", err)
		}
	}
	t.Logf("%d of %d appends refused: %v", nFailed, n, first)
	// The end marker is written all the same, and the replay gives every
	// message that was not refused, in order.
	mark(t, b, 0, 7)
	got, _ := replayAll(t, b, 0, 7)
	var want int
	for i := range n {
		if !failedMsgs[fmt.Sprintf("%d %s", i, data)] {
			if want >= len(got) || !strings.HasPrefix(string(got[want].Data), fmt.Sprintf("%d ", i)) {
				t.Fatalf("replayed message %d is not append %d", want, i)
			}
			want++
		}
	}
	if want != len(got) {
		t.Fatalf("replayed %d messages, %d were stored", len(got), want)
	}
	if !strings.Contains(logs.String(), "natshard_buf_buf") {
		t.Fatalf("no log line about the refusals:\n%s", logs)
	}
	// Purged after the replay: appends pass again.
	if err := b.Purge(testCtx(t), 0, 1<<62); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 10*time.Second, "an append after the purge", func() error {
		errc := make(chan error, 1)
		b.Append(0, &nats.Msg{Subject: subjects.Entity(0, "e"), Data: []byte("after")}, func(_ *nats.Msg, err error) { errc <- err })
		if err := b.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-errc:
			return err
		default:
			return nil
		}
	})
}

func openSpaceStore(t *testing.T, url, typ string, opts kvstate.Options) *kvstate.Store {
	t.Helper()
	js := natstest.JetStream(t, natstest.Connect(t, url))
	s, err := kvstate.Open(context.Background(), js, typ, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func newLogger(w *natstest.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }
