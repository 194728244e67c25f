package natshardtest_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/natshardtest"
)

// ticker is an entity with a timer: "tick" arms a periodic timer of 5 ms,
// "once" a single-shot of 5 ms, "count" answers its ticks. Every tick
// checks that it comes in the entity's turn (no other Handle running)
// and never after the incarnation's Stop.
type ticker struct {
	env      *natshard.Env
	ticks    int // the incarnation's own state: the race detector watches it
	inFlight atomic.Int32
	stopped  atomic.Bool
	probe    *probe
}

// probe is what the test reads of every incarnation of the entities.
type probe struct {
	ticks     atomic.Int64 // timer messages handled, all incarnations
	afterStop atomic.Int64 // timer messages handled after their incarnation's Stop
	overlaps  atomic.Int64 // Handles that ran while another ran
	stops     atomic.Int64
}

func (p *probe) factory(ctx context.Context, _ string) (natshard.Entity, error) {
	return &ticker{env: natshard.EnvFrom(ctx), probe: p}, nil
}

func (e *ticker) Handle(_ context.Context, m *natshard.Message) ([]byte, error) {
	if e.inFlight.Add(1) != 1 {
		e.probe.overlaps.Add(1)
	}
	defer e.inFlight.Add(-1)
	if m.Timer() != "" {
		if e.stopped.Load() {
			e.probe.afterStop.Add(1)
		}
		e.ticks++
		e.probe.ticks.Add(1)
		return nil, nil
	}
	switch string(m.Data) {
	case "tick":
		return nil, e.env.StartPeriodicTimer("tick", 5*time.Millisecond, nil)
	case "once":
		return nil, e.env.StartTimer("once", 5*time.Millisecond, nil)
	case "count":
		return []byte(strconv.Itoa(e.ticks)), nil
	}
	return nil, errors.New("unknown request")
}

func (e *ticker) Stop(context.Context) error {
	e.stopped.Store(true)
	e.probe.stops.Add(1)
	return nil
}

func ask(t *testing.T, c *natshardtest.Cluster, id, body string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), natshardtest.Timeout)
	defer cancel()
	got, err := c.Client().Request(ctx, "ticker", id, []byte(body))
	if err != nil {
		t.Fatalf("%s to %s: %v", body, id, err)
	}
	return string(got)
}

// TestTimers: in both delivery modes, on two nodes: an entity's periodic
// timer fires in its turn; a move of its shard and a passivation cancel
// it (no tick after the incarnation stopped, none on the new owner); a
// single-shot timer fires once.
func TestTimers(t *testing.T) {
	for _, delivery := range []natshard.Delivery{natshard.Core, natshard.Durable} {
		t.Run(string(delivery), func(t *testing.T) {
			p := &probe{}
			c := natshardtest.Run(t, natshardtest.Config{
				Nodes: 2,
				Types: []natshard.Type{{Name: "ticker", Entity: p.factory, Shards: 4, Delivery: delivery}},
			})
			const id = "e1"

			// Fires in the entity's turn, while requests keep it busy.
			ask(t, c, id, "tick")
			for range 20 {
				ask(t, c, id, "count")
			}
			c.Eventually("10 ticks", func() bool { return p.ticks.Load() >= 10 })

			// A move cancels it.
			from := c.OwnerOf("ticker", id)
			c.MoveEntity("ticker", id, 1-from)
			c.Eventually("the old incarnation stopped", func() bool { return p.stops.Load() == 1 })
			if got := ask(t, c, id, "count"); got != "0" {
				t.Fatalf("the new incarnation has %s ticks, want 0 (the timer is the activation's)", got)
			}
			// A single-shot timer of the same period, started after: the
			// cancelled timer's next tick was due before it fires.
			before := p.ticks.Load()
			marked := func(what string) {
				t.Helper()
				ask(t, c, id, "once")
				c.Eventually("the single-shot tick", func() bool { return p.ticks.Load() >= before+1 })
				if n := p.ticks.Load(); n != before+1 {
					t.Fatalf("%d ticks %s, where the single-shot timer ticked once", n-before, what)
				}
			}
			marked("after the move")

			// A passivation cancels it.
			ask(t, c, id, "tick")
			c.Eventually("ticks on the new owner", func() bool { return p.ticks.Load() >= before+3 })
			if !c.Passivate("ticker", id) {
				t.Fatal("no node held the entity")
			}
			before = p.ticks.Load()
			marked("after the passivation")

			// A single-shot timer fires once: not again before a second.
			before = p.ticks.Load()
			marked("after a single-shot timer")

			if n := p.afterStop.Load(); n != 0 {
				t.Fatalf("%d ticks after their incarnation stopped", n)
			}
			if n := p.overlaps.Load(); n != 0 {
				t.Fatalf("%d Handles ran beside another", n)
			}
		})
	}
}

// counter counts the requests to each id in memory, per incarnation.
type counter struct{ n int }

func (e *counter) Handle(context.Context, *natshard.Message) ([]byte, error) {
	e.n++
	return []byte(strconv.Itoa(e.n)), nil
}

func (e *counter) Stop(context.Context) error { return nil }

// TestKit: the kit's moves, crash, restart and passivation do what they
// say to an in-memory entity (whose count starts again with each
// incarnation).
func TestKit(t *testing.T) {
	var mu sync.Mutex
	activations := map[string]int{}
	typ := natshard.Type{Name: "ticker", Shards: 2, Entity: func(_ context.Context, id string) (natshard.Entity, error) {
		mu.Lock()
		activations[id]++
		mu.Unlock()
		return &counter{}, nil
	}}
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 2, Types: []natshard.Type{typ}})
	const id = "k"
	ask(t, c, id, "")
	if got := ask(t, c, id, ""); got != "2" {
		t.Fatalf("second request: %s, want 2", got)
	}
	c.Passivate("ticker", id)
	if got := ask(t, c, id, ""); got != "1" {
		t.Fatalf("after a passivation: %s, want 1 (a new incarnation)", got)
	}
	from := c.MoveEntity("ticker", id, 1-c.OwnerOf("ticker", id))
	if got := ask(t, c, id, ""); got != "1" {
		t.Fatalf("after a move: %s, want 1", got)
	}
	owner := c.OwnerOf("ticker", id)
	if owner == from {
		t.Fatalf("the entity's shard is still on node %d", from)
	}
	c.Crash(owner)
	c.Settle()
	if c.OwnerOf("ticker", id) != from {
		t.Fatalf("after the crash of node %d, the shard is on node %d", owner, c.OwnerOf("ticker", id))
	}
	if got := ask(t, c, id, ""); got != "1" {
		t.Fatalf("after a crash: %s, want 1", got)
	}
	c.Restart(owner)
	c.Settle()
	c.Move("ticker", c.ShardOf("ticker", id), owner)
	if got := ask(t, c, id, ""); got != "1" {
		t.Fatalf("after a restart and a move back: %s, want 1", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if activations[id] != 5 {
		t.Fatalf("%d activations, want 5", activations[id])
	}
}

// TestKitAddAndStop: a node added later takes the shards moved to it, and
// gives them back when it stops gracefully.
func TestKitAddAndStop(t *testing.T) {
	c := natshardtest.Start(t, natshard.Type{Name: "ticker", Shards: 2, Entity: func(context.Context, string) (natshard.Entity, error) {
		return &counter{}, nil
	}})
	const id = "k"
	ask(t, c, id, "")
	i := c.Add()
	if i != 1 || c.Nodes() != 2 {
		t.Fatalf("Add gave node %d of %d; want node 1 of 2", i, c.Nodes())
	}
	c.MoveEntity("ticker", id, i)
	if got := ask(t, c, id, ""); got != "1" {
		t.Fatalf("after a move to the new node: %s, want 1", got)
	}
	c.Stop(i)
	c.Settle()
	if c.Nodes() != 2 || c.Node(i) != nil {
		t.Fatalf("after node %d stopped: %d nodes, node %d is %v; want 2 counted, the stopped one nil", i, c.Nodes(), i, c.Node(i))
	}
	if o := c.OwnerOf("ticker", id); o != 0 {
		t.Fatalf("after node %d stopped the shard is on node %d", i, o)
	}
	if got := ask(t, c, id, ""); got != "1" {
		t.Fatalf("after a graceful stop: %s, want 1", got)
	}
}
