package natshard_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// gatedKV is a kv entity whose first incr waits at the gate until the
// test opens it, and which counts the incrs its Handle was given.
type gatedKV struct {
	region.Entity
	gate  <-chan struct{}
	incrs *atomic.Int32
}

func (g gatedKV) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	if strings.Contains(string(m.Data), `"incr"`) {
		g.incrs.Add(1)
		select {
		case <-g.gate:
		case <-ctx.Done():
		}
	}
	return g.Entity.Handle(ctx, m)
}

// Answer is the kv entity's: what it saved with its document.
func (g gatedKV) Answer(key string) (region.KeptAnswer, bool) {
	if k, ok := g.Entity.(region.AnswerKeeper); ok {
		return k.Answer(key)
	}
	return region.KeptAnswer{}, false
}

// TestIdempotencyKeys (docs/FAULTS.md, "Guarantees": "Idempotency keys mean
// what they say"), in both delivery modes: one incr request is sent with one
// key (MsgID) three times: the second while the first is in flight (its entity
// holds it), the third after a move of its shard to the other node; in durable
// delivery a fourth after that node's crash (its connection closed, no
// handoff). The persistent kv entity applies it once (n is 1, Handle saw one
// incr) and every call gets the first answer. Before idempotency keys kept
// answers, the core resends were applied again (n = 3) and the durable ones
// waited for an answer that never came (the stream dropped them as
// duplicates).
func TestIdempotencyKeys(t *testing.T) {
	for _, delivery := range []natshard.Delivery{natshard.Core, natshard.Durable} {
		t.Run(string(delivery), func(t *testing.T) { testIdempotencyKeys(t, delivery) })
	}
}

func testIdempotencyKeys(t *testing.T, delivery natshard.Delivery) {
	const typ, id, key = "kv", "acct-1", "op-1"
	url := natstest.URL(natstest.RunServer(t))
	ctx := context.Background()
	gate := make(chan struct{})
	var incrs atomic.Int32
	kv := entities.KV(nil)
	entity := func(ctx context.Context, id string) (natshard.Entity, error) {
		e, err := kv(ctx, id)
		if err != nil {
			return nil, err
		}
		return gatedKV{Entity: e, gate: gate, incrs: &incrs}, nil
	}
	nodes := map[string]*natshard.Node{}
	conns := map[string]*nats.Conn{}
	for _, r := range []string{"a", "b"} {
		nc, err := nats.Connect(url, natshard.ConnectOptions()...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		// b has no coordinator: its crash leaves a's coordinator to
		// re-home its shards.
		n, err := natshard.Start(ctx, natshard.Options{Conn: nc, Region: r, NoCoordinator: r == "b", Logger: quiet},
			natshard.Type{Name: typ, Kind: "kv", Shards: 4, MinRegions: 2, RebalanceInterval: natshard.Off, Delivery: delivery, Entity: entity})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(ctx) })
		nodes[r], conns[r] = n, nc
	}
	held := func(r string) []int { s, _ := nodes[r].Stats(typ); return s.Shards }
	delivered := func() uint64 {
		var d uint64
		for _, n := range nodes {
			s, _ := n.Stats(typ)
			d += s.Delivered
		}
		return d
	}
	natstest.Eventually(t, 20*time.Second, "every shard held", func() bool { return len(held("a"))+len(held("b")) == 4 })
	shard := protocol.ShardOf(id, 4)
	admin := natstest.Connect(t, url)
	move := func(to string) {
		t.Helper()
		natstest.Eventually(t, 20*time.Second, fmt.Sprintf("shard %d moved to %s", shard, to), func() bool {
			if slices.Contains(held(to), shard) {
				return true
			}
			_, err := admin.Request(protocol.MustSubjects("", "", typ).Admin(protocol.AdminMove), fmt.Appendf(nil, `{"shard":%d,"region":%q}`, shard, to), 5*time.Second)
			if err != nil {
				t.Fatalf("move of shard %d to %s: %v", shard, to, err)
			}
			return false
		})
		natstest.Eventually(t, 20*time.Second, fmt.Sprintf("shard %d on %s alone", shard, to), func() bool {
			other := map[string]string{"a": "b", "b": "a"}[to]
			return !slices.Contains(held(other), shard)
		})
	}
	move("a") // so that the move after the first two goes to b

	c := natshard.NewClient(natstest.Connect(t, url), natshard.WithTimeout(time.Minute))
	// Answered once the shard is live on a. A message that arrives while
	// a replays the shard's buffer is delivered at the end of the replay,
	// and for a moment after that another message with its key is
	// skipped as a late copy of it (region/replay.go), answered only when
	// the client sends it again (keyedResend): the second send must meet
	// a live shard to be delivered while the first is held.
	if _, err := c.Request(ctx, typ, id, []byte(`{"op":"get"}`)); err != nil {
		t.Fatal(err)
	}
	incr := []byte(`{"op":"incr","key":"n"}`)
	send := func() ([]byte, error) { return c.Request(ctx, typ, id, incr, natshard.MsgID(key)) }
	type result struct {
		data []byte
		err  error
	}
	results := make(chan result, 2)
	before := delivered()
	var wg sync.WaitGroup
	wg.Go(func() { data, err := send(); results <- result{data, err} })
	natstest.Eventually(t, 20*time.Second, "the first incr at its entity", func() bool { return incrs.Load() == 1 })
	wg.Go(func() { data, err := send(); results <- result{data, err} })
	// The second reached the entity's region while the first is held
	// (in durable delivery: the request for the first's answer).
	natstest.Eventually(t, 20*time.Second, "the second send delivered", func() bool { return delivered() >= before+2 })
	close(gate)
	wg.Wait()
	close(results)
	var answers []string
	for r := range results {
		if r.err != nil {
			t.Fatalf("a send while the first was in flight: %v", r.err)
		}
		answers = append(answers, string(r.data))
	}

	move("b")
	data, err := send()
	if err != nil {
		t.Fatalf("the send after a move: %v", err)
	}
	answers = append(answers, string(data))

	if delivery == natshard.Durable {
		conns["b"].Close() // b crashes: a gets the shard, without handoff
		data, err := send()
		if err != nil {
			t.Fatalf("the send after the owner's crash: %v", err)
		}
		answers = append(answers, string(data))
	}

	for i, a := range answers {
		if a != `{"ok":true,"value":1}` {
			t.Errorf("answer %d of %d: %s, want the first, {\"ok\":true,\"value\":1}", i+1, len(answers), a)
		}
	}
	got, err := c.Request(ctx, typ, id, []byte(`{"op":"get","key":"n"}`))
	if err != nil || string(got) != `{"ok":true,"value":1}` {
		t.Errorf("n after %d sends of one key: %s, %v; want 1: applied once", len(answers), got, err)
	}
	if n := incrs.Load(); n != 1 {
		t.Errorf("the entity's Handle was given the incr %d times, want once", n)
	}
}
