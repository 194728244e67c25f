package coordinator

import (
	"context"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestLongBatchRenewsTheLease: the leader carries out its table writes,
// in batches of at most kvstate.MaxShardBatch rows, in the loop that
// renews its lease, so a long run of them (a first allocation of many
// shards: 3 writes each) could outlast the lease; its writes would then
// be refused as fenced and the next term would start over. A batch whose
// renewal is due renews first. The test makes the renewal due without
// waiting: the last renewal is said to have been sent 300 ms ago (a
// 1 s lease is renewed every 250 ms).
func TestLongBatchRenewsTheLease(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, nc), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	info := protocol.CoordinatorInfo{Region: "c1", Incarnation: "c1-1"}
	lease, err := store.AcquireCoordinator(ctx, info, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	n := New(Config{Conn: nc, Store: store, Subjects: protocol.MustSubjects("", "", "kv"), Shards: 4, LeaseTTL: time.Second})
	l := &leader{Node: n, info: info, lease: lease, renewedAt: time.Now().Add(-300 * time.Millisecond)}
	l.core, _ = NewCore(CoreConfig{Shards: 4}, "c1", lease.Revision, nil, nil)
	l.track = newMoveTracker(n.cfg.Stats, nil, 4, nil)
	defer l.track.stop()

	before := l.renewedAt
	rec := protocol.ShardRecord{Shard: 0, State: protocol.StateParked, Epoch: lease.Revision, Handoff: 1}
	if err := l.execute(ctx, []Action{WriteShard{Record: rec}}); err != nil {
		t.Fatal(err)
	}
	if !l.renewedAt.After(before) || l.lease.Revision == lease.Revision {
		t.Fatalf("a table write with the renewal due did not renew the lease (revision %d, still %d)", lease.Revision, l.lease.Revision)
	}
	// The write went out under the renewed lease.
	table, err := store.Shards(ctx)
	if err != nil || len(table) != 1 || table[0].State != protocol.StateParked {
		t.Fatalf("table %+v, %v", table, err)
	}
}

// TestWaitsForWrites: the table writes held for a batch go before every
// action but log lines, the Park of a shard they do not touch and an
// Unpark (execute starts those after its last writes).
func TestWaitsForWrites(t *testing.T) {
	writes := []protocol.ShardRecord{{Shard: 1}, {Shard: 2}}
	for _, tc := range []struct {
		a    Action
		want bool
	}{
		{Park{Shard: 3}, false},
		{Park{Shard: 2}, true},
		{Warn{Msg: "x"}, false},
		{RoundPlanned{}, false},
		{RoundDone{}, false},
		{NoRound{}, false},
		{Send{Region: "r"}, true},
		{Unpark{Shard: 3}, false}, // gathered, and started after the last writes
		{Mark{Shard: 3}, true},
		{WritePin{Shard: 3}, true},
		{RemoveRegion{ID: "r"}, true},
		{StepDown{}, true},
	} {
		if got := waitsForWrites(tc.a, writes); got != tc.want {
			t.Errorf("%T %+v: waits %v, want %v", tc.a, tc.a, got, tc.want)
		}
	}
}
