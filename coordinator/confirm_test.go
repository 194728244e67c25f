package coordinator

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// TestConfirmOwners: a takeover whose listing of the regions is short of a
// live one, or holds an older registration of it, reads it from the stream
// leader instead of re-homing its shards (core seed 50 of the campaign,
// docs/FAULTS.md); a region that is gone stays gone.
func TestConfirmOwners(t *testing.T) {
	_, store, _, _ := openKV(t)
	ctx := context.Background()
	reg := func(id, inc string) RegionSeen {
		t.Helper()
		info := protocol.RegionInfo{ID: id, Incarnation: inc, Version: "test"}
		l, err := store.RegisterRegion(ctx, info, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return RegionSeen{Info: info, Revision: l.Revision}
	}
	r0 := reg("r0", "a")
	reg("r1", "old")
	r1 := reg("r1", "new")
	r2 := reg("r2", "a")
	gone := reg("r3", "a")
	if err := store.RemoveRegion(ctx, "r3", gone.Revision); err != nil {
		t.Fatal(err)
	}
	table := []protocol.ShardRecord{
		{Shard: 0, Region: "r0", Incarnation: "a", State: protocol.StateActive},
		{Shard: 1, Region: "r1", Incarnation: "new", State: protocol.StateActive},
		{Shard: 2, Region: "r2", Incarnation: "a", State: protocol.StateActive},
		{Shard: 3, Region: "r3", Incarnation: "a", State: protocol.StateActive},
		{Shard: 4, Region: "r0", Incarnation: "a", State: protocol.StateBinding, Source: "r2", SourceIncarnation: "a"},
	}
	// The listing lacks r2 and holds r1's previous incarnation.
	listed := []RegionSeen{r0, {Info: protocol.RegionInfo{ID: "r1", Incarnation: "old", Version: "test"}, Revision: r0.Revision + 1}}
	var reads []string
	region := func(ctx context.Context, id string) (protocol.RegionInfo, uint64, error) {
		reads = append(reads, id)
		return store.Region(ctx, id)
	}
	got, err := confirmOwners(ctx, region, table, listed)
	if err != nil {
		t.Fatal(err)
	}
	if want := []RegionSeen{r0, r1, r2}; !slices.Equal(got, want) {
		t.Errorf("regions %v, want %v", got, want)
	}
	slices.Sort(reads)
	if want := []string{"r1", "r2", "r3"}; !slices.Equal(reads, want) {
		t.Errorf("read %v from the leader, want %v (once each, none for a region listed as the rows name it)", reads, want)
	}
}
