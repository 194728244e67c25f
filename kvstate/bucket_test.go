package kvstate

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestBucketConfig: the bucket Open creates is the one nats.go's
// CreateKeyValue makes of the same KeyValueConfig, with atomic batches
// allowed besides (bucketConfig copies nats.go's mapping, which a new
// nats.go may change).
func TestBucketConfig(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	js := natstest.JetStream(t, nc)
	ctx := t.Context()
	for _, maxBytes := range []int64{0, 1 << 20} {
		s, err := Open(ctx, js, fmt.Sprintf("ours%d", maxBytes), Options{MaxBytes: maxBytes})
		if err != nil {
			t.Fatal(err)
		}
		theirs := BucketName(fmt.Sprintf("theirs%d", maxBytes))
		if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: theirs, History: 1, Storage: jetstream.FileStorage,
			LimitMarkerTTL: markerTTL, MaxBytes: maxBytes,
		}); err != nil {
			t.Fatal(err)
		}
		config := func(bucket string) jetstream.StreamConfig {
			st, err := js.Stream(ctx, "KV_"+bucket)
			if err != nil {
				t.Fatal(err)
			}
			c := st.CachedInfo().Config
			if want := []string{"$KV." + bucket + ".>"}; !slices.Equal(c.Subjects, want) {
				t.Errorf("bucket %s's stream has subjects %v, want %v", bucket, c.Subjects, want)
			}
			c.Name, c.Subjects, c.Description, c.Metadata = "", nil, "", nil
			return c
		}
		ours, want := config(s.bucket), config(theirs)
		if !ours.AllowAtomicPublish {
			t.Errorf("MaxBytes %d: the bucket does not take atomic batches", maxBytes)
		}
		ours.AllowAtomicPublish = false
		if !reflect.DeepEqual(ours, want) {
			t.Errorf("MaxBytes %d: the bucket's stream is\n%+v\nnats.go's KV bucket's\n%+v", maxBytes, ours, want)
		}
	}
}

// TestPutShardsOverMaxBatchSize: a server whose max_batch_size is under
// MaxShardBatch refuses a larger batch; PutShards writes none of its rows
// and says so (ErrBatchRefused), and the Store has rows go one at a time
// from then on (docs/OPERATIONS.md, Atomic batches).
func TestPutShardsOverMaxBatchSize(t *testing.T) {
	opts := natstest.DefaultOptions(t)
	opts.JetStreamLimits.MaxBatchSize = 100
	url := natstest.URL(natstest.RunServerWithOptions(t, opts))
	s := openStore(t, url, "small", Options{})
	l, err := s.AcquireCoordinator(t.Context(), coordInfo("a"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var recs []protocol.ShardRecord
	for n := range 101 { // over the server's bound
		recs = append(recs, shardRec(n, "r", l.Revision))
	}
	if !s.Batches(len(recs)) {
		t.Fatalf("Batches(%d) is false before any batch was refused", len(recs))
	}
	if err := s.PutShards(t.Context(), l, recs); !errors.Is(err, ErrBatchRefused) {
		t.Fatalf("PutShards of %d rows: %v, want ErrBatchRefused", len(recs), err)
	}
	checkTable(t, s, map[int]string{})
	if s.Batches(len(recs)) {
		t.Fatal("Batches says yes after the server refused a batch as too large")
	}
}

// TestBatchesFollowRowTime: on a one-replica bucket PutShards sends a
// batch from batchFrom rows, and from fewer when rows written alone take
// so long that the rows would cost more than a batch's staging; never
// one row, nor where the bucket takes no batches. On a replicated
// bucket, from two rows.
func TestBatchesFollowRowTime(t *testing.T) {
	s := &Store{batchFrom: batchFrom(1)}
	s.atomicBatches.Store(true)
	for _, tc := range []struct {
		row  time.Duration // moving average of a row alone; 0: none written yet
		n    int
		want bool
	}{
		{0, 22, false},
		{0, 100, true},
		{41 * time.Microsecond, 22, false}, // idle: 22 rows alone cost 0.9 ms
		{41 * time.Microsecond, 99, true},  // 98 x 41 µs > 3 ms
		{250 * time.Millisecond, 2, true},  // loaded
		{250 * time.Millisecond, 1, false},
	} {
		s.rowTime.Store(int64(tc.row))
		if got := s.Batches(tc.n); got != tc.want {
			t.Errorf("rows alone at %v: Batches(%d) = %v, want %v", tc.row, tc.n, got, tc.want)
		}
	}
	s.atomicBatches.Store(false)
	if s.Batches(100) {
		t.Error("Batches(100) on a bucket that takes no batches")
	}
	r3 := &Store{batchFrom: batchFrom(3)}
	r3.atomicBatches.Store(true)
	if !r3.Batches(2) || r3.Batches(1) {
		t.Errorf("replicated: Batches(2) = %v, Batches(1) = %v", r3.Batches(2), r3.Batches(1))
	}

	// The average follows the rows written alone.
	s = &Store{}
	s.rowWritten(8 * time.Millisecond)
	for range 80 {
		s.rowWritten(40 * time.Microsecond)
	}
	if got := time.Duration(s.rowTime.Load()); got > 45*time.Microsecond {
		t.Errorf("after 80 rows of 40 µs the average is %v", got)
	}
}

// TestLookupStreamNotFoundYet: a stream created but still not found when
// the lookup's context ends (a cluster electing) is ErrUnavailable, which
// natshard's start waits for, not a failure.
func TestLookupStreamNotFoundYet(t *testing.T) {
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(natstest.RunServer(t))))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := lookupStream(ctx, js, "never_made")
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("a stream not found until the lookup's context ended: %v; want ErrUnavailable", err)
	}
}
