package coordinator

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// TestExecuteBatches: a term's table writes go to the store in batches of
// at most kvstate.MaxShardBatch rows (PutShards refuses more): 2 500 rows,
// as one step of a large type's first allocation writes, with the Park of
// one of them after the 1 501st (which sends the batch before it), all
// land and the parking starts. Without the flush of a full batch, execute
// fails with 1 501 rows in one PutShards. (That the Park waits for its
// row, waitsForWrites, is not seen here.)
func TestExecuteBatches(t *testing.T) {
	const shards = 2500
	nc, store, buffer, subjects := openKV(t)
	ctx := context.Background()
	info := protocol.CoordinatorInfo{Region: "c1", Incarnation: "i1"}
	lease, err := store.AcquireCoordinator(ctx, info, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	info.Epoch = lease.Revision
	n := New(Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "c1",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer n.parker.stop()
	core, _ := NewCore(CoreConfig{Shards: shards}, "c1", info.Epoch, nil, nil)
	l := &leader{Node: n, info: info, lease: lease, renewedAt: time.Now(), core: core,
		track: newMoveTracker(n.cfg.Stats, nil, shards, nil)}

	const parked = 1200
	var acts []Action
	for sh := range shards {
		acts = append(acts, WriteShard{Record: protocol.ShardRecord{Shard: sh, State: protocol.StateParked, Epoch: info.Epoch, Handoff: uint64(sh + 1)}})
		if sh == 1500 {
			acts = append(acts, Park{Shard: parked, Handoff: parked + 1})
		}
	}
	if err := l.execute(ctx, acts); err != nil {
		t.Fatal(err)
	}
	rows, err := store.Shards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != shards {
		t.Fatalf("%d rows in the table, want %d", len(rows), shards)
	}
	for i, r := range rows {
		if r.Shard != i || r.State != protocol.StateParked || r.Handoff != uint64(i+1) {
			t.Fatalf("row %d: %+v", i, r)
		}
	}
	n.parker.mu.Lock()
	pk := n.parker.parked[parked]
	n.parker.mu.Unlock()
	if pk == nil || pk.handoff != parked+1 || pk.term != info.Epoch {
		t.Fatalf("shard %d's parking: %+v", parked, pk)
	}
}
