package region_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestStallSuspendsUntilConfirmed (PROTOCOL.md, Zombie regions): a region
// that did not run for longer than its stall limit (its process was
// stopped) may have lost shards meanwhile: the coordinator gave shard 1 to
// another region. Its messages, taken from the subscription once the
// region runs again, must not reach the entity: the region suspends its
// shards, renews its registration and confirms them against the table,
// serves shard 0 again (what it held first, in order) and drops what it
// held for shard 1, unanswered (r2 answers its own copies).
func TestStallSuspendsUntilConfirmed(t *testing.T) {
	f := newFixture(t) // stall limit: a minute
	ctx := context.Background()
	f.bind(t, f.epoch, 0, 1)
	natstest.Eventually(t, 30*time.Second, "shards 0 and 1 live", func() bool { return f.agent.Status().Live == 2 })
	for _, row := range []protocol.ShardRecord{
		{Shard: 0, Region: "r1", Incarnation: f.inc, State: protocol.StateActive, Epoch: f.epoch},
		{Shard: 1, Region: "r2", Incarnation: "other", State: protocol.StateBinding, Epoch: f.epoch}, // given away meanwhile
	} {
		if _, err := f.store.PutShard(ctx, f.lease, row); err != nil {
			t.Fatal(err)
		}
	}
	// One inbox a shard: the region may confirm its shards while the
	// messages are still being sent (the watch finds the stall within
	// 100 ms), and then NATS answers what follows for shard 1 "no
	// responders" itself.
	var answers [2]*nats.Subscription
	for i := range answers {
		var err error
		if answers[i], err = f.nc.SubscribeSync(nats.NewInbox()); err != nil {
			t.Fatal(err)
		}
	}

	f.agent.Stall(2 * time.Minute)
	const n = 20
	for i := range n {
		for _, shard := range []int{0, 1} {
			m := nats.NewMsg(f.subjects.EntityOf(idIn(shard), shards))
			m.Reply, m.Data = answers[shard].Subject, fmt.Appendf(nil, "%d-%d", shard, i)
			if err := f.nc.PublishMsg(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	got := answersFor(t, answers[0], n)
	want := make([]string, n)
	for i := range want {
		want[i] = fmt.Sprintf("0-%d", i)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("shard 0 answered %v; want %v", got, want)
	}
	for {
		m, err := answers[1].NextMsg(200 * time.Millisecond)
		if errors.Is(err, nats.ErrNoResponders) {
			continue
		}
		if err == nil {
			t.Fatalf("shard 1, r2's to answer, answered here %q (headers %v)", m.Data, m.Header)
		}
		break
	}
	st := f.agent.Stats()
	// The watch and a delivery may each find the stall: it is handled
	// (counted, confirmed) once.
	if h := f.agent.Held(); !slices.Equal(h, []int{0}) || st.Stalls.Load() != 1 || st.Confirmed.Load() != 1 || st.Fenced.Load() != 0 {
		t.Fatalf("held %v, stalls %d, confirmed %d, fenced %d", h, st.Stalls.Load(), st.Confirmed.Load(), st.Fenced.Load())
	}
}
