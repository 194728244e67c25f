package region

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// memoryRemember is a RememberStore in memory, with a log of its writes.
type memoryRemember struct {
	mu     sync.Mutex
	ids    map[int]map[string]bool
	writes []kvstate.EntityRecord
	fail   error // when set, RecordEntities fails with it
}

func newMemoryRemember() *memoryRemember { return &memoryRemember{ids: map[int]map[string]bool{}} }

func (m *memoryRemember) RecordEntities(_ context.Context, recs []kvstate.EntityRecord) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail != nil {
		return m.fail
	}
	for _, r := range recs {
		if m.ids[r.Shard] == nil {
			m.ids[r.Shard] = map[string]bool{}
		}
		if r.Forget {
			delete(m.ids[r.Shard], r.ID)
		} else {
			m.ids[r.Shard][r.ID] = true
		}
		m.writes = append(m.writes, r)
	}
	return nil
}

func (m *memoryRemember) RememberedEntities(_ context.Context, shard int) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var ids []string
	for id := range m.ids[shard] {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids, nil
}

// TestPacer: restarts go at the rate, after a burst of restartBurst's
// worth; a pause lets a new burst go, never more.
func TestPacer(t *testing.T) {
	clock := hosttest.NewClock()
	var slept time.Duration
	p := &pacer{every: 10 * time.Millisecond, now: clock.Now, sleep: func(_ context.Context, d time.Duration) bool {
		slept += d
		clock.Advance(d)
		return true
	}}
	ctx := context.Background()
	// 11 go at once (100 ms at 10 ms each, and the one due now), then one
	// every 10 ms.
	for i := range 11 {
		p.wait(ctx)
		if slept != 0 {
			t.Fatalf("restart %d of the burst waited %v", i, slept)
		}
	}
	for range 50 {
		p.wait(ctx)
	}
	if slept != 500*time.Millisecond {
		t.Fatalf("50 restarts after the burst waited %v, want 500ms", slept)
	}
	clock.Advance(time.Hour) // idle: a burst again, of the same size
	slept = 0
	for range 20 {
		p.wait(ctx)
	}
	if slept != 90*time.Millisecond {
		t.Fatalf("20 restarts after a pause waited %v, want 90ms", slept)
	}
}

// TestRememberedAcrossSplit: after a split, a shard lists the remembered
// entities recorded under its number and under its ancestors' (from
// before the split) that are its own now, and none of another child's;
// forgetting an entity purges its key under each of those numbers.
func TestRememberedAcrossSplit(t *testing.T) {
	store := newMemoryRemember()
	a := &Agent{log: slog.New(slog.DiscardHandler), cfg: Config{Shards: 8, Remember: store}}
	layout := protocol.MustLayout(4, 8)
	a.layout.Store(&layout)
	var in1, in5 []string
	for i := 0; len(in1) < 3 || len(in5) < 3; i++ {
		id := "e-" + strconv.Itoa(i)
		switch layout.ShardOf(id) {
		case 1:
			in1 = append(in1, id)
		case 5:
			in5 = append(in5, id)
		}
	}
	// Recorded before the split, under their parent 1; in5[2] after it.
	var recs []kvstate.EntityRecord
	for _, id := range append(slices.Clone(in1), in5[:2]...) {
		recs = append(recs, kvstate.EntityRecord{Shard: 1, ID: id})
	}
	recs = append(recs, kvstate.EntityRecord{Shard: 5, ID: in5[2]})
	if err := store.RecordEntities(context.Background(), recs); err != nil {
		t.Fatal(err)
	}
	for shard, want := range map[int][]string{1: in1, 5: in5} {
		got, err := a.remembered(context.Background(), shard)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		want = slices.Sorted(slices.Values(want))
		if !slices.Equal(got, want) {
			t.Errorf("shard %d remembers %v, want %v", shard, got, want)
		}
	}
	r := newEntityRecorder(a, store)
	ctx, cancel := context.WithCancel(context.Background())
	a.wg.Add(1)
	go r.run(ctx)
	defer func() { cancel(); a.wg.Wait() }()
	r.forget(5, in5[0])
	if got, _ := a.remembered(context.Background(), 5); slices.Contains(got, in5[0]) {
		t.Fatalf("forgotten entity %s still remembered by shard 5: %v", in5[0], got)
	}
	if got, _ := store.RememberedEntities(context.Background(), 1); slices.Contains(got, in5[0]) {
		t.Fatalf("forgotten entity %s still under its parent's number", in5[0])
	}
}
