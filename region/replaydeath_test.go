package region_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// TestTargetKilledWhileReplaying (PROTOCOL.md, Handoff, "B dies before or
// while replaying"): the coordinator binds the shard to another target
// with the same handoff, and that one replays what is left of the buffer.
// The first target purged behind itself as its entities handled what it
// replayed, so the second handles again at most region.ReplayAhead keyed
// messages per entity, and loses none.
//
// Before, the first target purged only at the end marker, and the second
// handled again everything the first had: in the fault campaign (core
// seed 76) 206 messages, keys older than a kv entity's window applied
// twice.
func TestTargetKilledWhileReplaying(t *testing.T) {
	c := newCluster(t, kvstate.BufferOptions{})
	var (
		mu      sync.Mutex
		handled = map[string]map[string][]int{} // region -> entity -> payloads, in order
	)
	slow := func(regionID string) func(*region.Config) {
		return func(cfg *region.Config) {
			cfg.Factory = func(_ context.Context, id string) (region.Entity, error) {
				return slowEntity(func(m *region.Message) {
					time.Sleep(2 * time.Millisecond)
					n, err := strconv.Atoi(string(m.Data))
					if err != nil {
						t.Errorf("payload %q", m.Data)
					}
					mu.Lock()
					defer mu.Unlock()
					if handled[regionID] == nil {
						handled[regionID] = map[string][]int{}
					}
					handled[regionID][id] = append(handled[regionID][id], n)
				}), nil
			}
		}
	}
	count := func(regionID string) int {
		mu.Lock()
		defer mu.Unlock()
		return handledIn(handled[regionID])
	}
	_, _, proxy := c.addProxiedAgent("a", slow("a"))
	c.addAgent("b", slow("b"))

	// Two entities of one shard: one with most of the buffer, the other
	// every 11th message.
	const total = 220
	ids := idsIn("replay", 2, []int{5})
	s := protocol.ShardOf(ids[0], shards)
	for seq := 1; seq <= total; seq++ {
		id := ids[0]
		if seq%11 == 0 {
			id = ids[1]
		}
		c.buffer.Append(s, c.message(id, seq, true), func(m *nats.Msg, err error) { t.Errorf("append %s: %v", m.Data, err) })
	}
	// The end marker comes later (the source is still appending, as in
	// the campaign): a has read everything there is long before.
	hs := c.newHandoffs(1)
	c.must("a", protocol.Command{Kind: protocol.CmdBind, Shards: []int{s}, Handoffs: hs})
	natstest.Eventually(t, 30*time.Second, "a to handle half the buffer", func() bool { return count("a") >= total/2 })
	// a dies: nothing it sends reaches the server from now on. Its
	// entities may still handle what it had delivered.
	proxy.Cut(time.Hour)
	aBefore := count("a")
	if _, err := c.buffer.Mark(context.Background(), s, hs[0]); err != nil {
		t.Fatal(err)
	}
	c.must("b", protocol.Command{Kind: protocol.CmdBind, Shards: []int{s}, Handoffs: hs})
	natstest.Eventually(t, 60*time.Second, "b to finish the replay", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			seqs := handled["b"][id]
			if len(seqs) == 0 || seqs[len(seqs)-1] != lastOf(id, ids, total) {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	t.Logf("a handled %d (%d before its death), b %d", handledIn(handled["a"]), aBefore, handledIn(handled["b"]))
	for _, id := range ids {
		byA, byB := handled["a"][id], handled["b"][id]
		twice := 0
		for _, n := range byB {
			if slices.Contains(byA, n) {
				twice++
			}
		}
		if twice > region.ReplayAhead {
			t.Errorf("entity %s: %d messages handled by both targets, want at most %d (a handled %d, b %d)", id, twice, region.ReplayAhead, len(byA), len(byB))
		}
		// Nothing lost, each target in order.
		all := map[int]bool{}
		for _, n := range append(slices.Clone(byA), byB...) {
			all[n] = true
		}
		for seq := 1; seq <= total; seq++ {
			if (seq%11 == 0) == (id == ids[1]) && !all[seq] {
				t.Errorf("entity %s: %d lost", id, seq)
			}
		}
		if !slices.IsSorted(byA) || !slices.IsSorted(byB) {
			t.Errorf("entity %s: out of order: a %v, b %v", id, byA, byB)
		}
	}
}

// lastOf is the last payload of entity id among 1..total (ids[1] gets
// every 11th).
func lastOf(id string, ids []string, total int) int {
	for seq := total; seq > 0; seq-- {
		if (seq%11 == 0) == (id == ids[1]) {
			return seq
		}
	}
	panic(fmt.Sprintf("no payload of %s", id))
}

// handledIn counts the payloads of every entity.
func handledIn(m map[string][]int) int {
	n := 0
	for _, seqs := range m {
		n += len(seqs)
	}
	return n
}

// slowEntity calls its function for each message.
type slowEntity func(m *region.Message)

func (e slowEntity) Handle(_ context.Context, m *region.Message) ([]byte, error) {
	e(m)
	return nil, nil
}

func (slowEntity) Stop(context.Context) error { return nil }
