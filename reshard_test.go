package natshard_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/natshardtest"
	"github.com/natshard/natshard/protocol"
)

// counting entities record the payloads they handle, in order, and the
// shard their Env names.
type counting struct {
	mu     sync.Mutex
	got    map[string][]string
	shards map[string]int
}

func (c *counting) factory(ctx context.Context, id string) (natshard.Entity, error) {
	env := natshard.EnvFrom(ctx)
	c.mu.Lock()
	c.shards[id] = env.Shard
	c.mu.Unlock()
	return countingEntity{c: c, id: id}, nil
}

type countingEntity struct {
	c  *counting
	id string
}

func (e countingEntity) Handle(_ context.Context, m *natshard.Message) ([]byte, error) {
	e.c.mu.Lock()
	e.c.got[e.id] = append(e.c.got[e.id], string(m.Data))
	e.c.mu.Unlock()
	return m.Data, nil
}

func (countingEntity) Stop(context.Context) error { return nil }

// oldSubject sums the old-subject counts of the cluster's nodes.
func oldSubject(c *natshardtest.Cluster, typ string) uint64 {
	var n uint64
	for i := range c.Nodes() {
		if node := c.Node(i); node != nil {
			if s, ok := node.Stats(typ); ok {
				n += s.OldSubject
			}
		}
	}
	return n
}

// TestReshard (issue 35): a running type of 8 shards on three nodes is
// split to 16 with natshard.Reshard: the nodes serve every child, the
// Client learns the new count, entities keep their messages' order, a
// publisher with the old count still reaches them (and is counted), a
// process started with the old count takes the new one, and one with a
// count the type never had is refused, naming both. A second split, to
// 64, follows at once.
func TestReshard(t *testing.T) {
	rec := &counting{got: map[string][]string{}, shards: map[string]int{}}
	typ := natshard.Type{Name: "rs", Shards: 8, Entity: rec.factory}
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 3, Types: []natshard.Type{typ}})
	c.Settle()
	ctx := t.Context()
	client := c.Client()
	old := natstest.Connect(t, c.URL()) // a publisher that keeps 8
	subjects := protocol.MustSubjects("", "", "rs")
	var ids []string
	for i := range 40 {
		ids = append(ids, "e-"+strconv.Itoa(i))
	}
	sent := map[string]int{}
	send := func(rounds int) {
		t.Helper()
		for range rounds {
			for _, id := range ids {
				sent[id]++
				if _, err := client.Request(ctx, "rs", id, []byte(strconv.Itoa(sent[id]))); err != nil {
					t.Fatal(err)
				}
				if err := old.PublishMsg(&nats.Msg{Subject: subjects.EntityOf(id, 8), Data: []byte("old " + strconv.Itoa(sent[id]))}); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	send(2)

	admin := natstest.Connect(t, c.URL())
	var progress []string
	from, err := natshard.Reshard(ctx, admin, "rs", 16, natshard.ReshardProgress(func(s string) { progress = append(progress, s) }))
	if err != nil || from != 8 {
		t.Fatalf("Reshard = %d, %v", from, err)
	}
	t.Logf("progress: %q", progress)
	c.Settle()
	if n := c.ShardOf("rs", "e-1"); n != protocol.ShardOf("e-1", 16) {
		t.Fatalf("the kit sees shard %d of e-1; of 16 it is %d", n, protocol.ShardOf("e-1", 16))
	}
	before := oldSubject(c, "rs")
	send(2)
	c.Eventually("the old publisher's messages counted", func() bool { return oldSubject(c, "rs") > before })
	// The Client sends by 16 now: its requests come on no old subject.
	c.Eventually("the old publisher's messages handled", func() bool { return handledAll(rec, sent) })
	// The Client learns the new count from its watch (at once, but not
	// in the Reshard call's goroutine): its requests come on no old
	// subject then.
	c.Eventually("the Client sending by 16", func() bool {
		quiet := oldSubject(c, "rs")
		for _, id := range ids {
			if _, err := client.Request(ctx, "rs", id, []byte("new")); err != nil {
				t.Fatal(err)
			}
		}
		return oldSubject(c, "rs") == quiet
	})
	for _, id := range ids {
		rec.mu.Lock()
		shard := rec.shards[id]
		rec.mu.Unlock()
		if want := protocol.ShardOf(id, 16); shard != want {
			t.Fatalf("entity %s activated with Env.Shard %d, want %d", id, shard, want)
		}
	}

	// A node started with the old count takes the stored one.
	i := c.Add()
	if got, _ := c.Node(i).Type("rs"); got.Shards != 16 {
		t.Fatalf("a node configured with 8 shards applies %d", got.Shards)
	}
	// One configured with a count the type never had is refused.
	bad := natshard.Type{Name: "rs", Shards: 12, Entity: rec.factory}
	if _, err := natshard.Start(ctx, natshard.Options{NATS: c.URL(), Region: "bad"}, bad); err == nil || !strings.Contains(err.Error(), "12") || !strings.Contains(err.Error(), "16") {
		t.Fatalf("a node with 12 shards: %v; want a refusal naming 12 and 16", err)
	}

	// A second split at once: 16 to 64.
	if from, err := c.Node(0).Reshard(ctx, "rs", 64); err != nil || from != 16 {
		t.Fatalf("second Reshard = %d, %v", from, err)
	}
	c.Settle()
	send(1)
	c.Eventually("every message handled", func() bool { return handledAll(rec, sent) })
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, id := range ids {
		var client, oldPub []string
		for _, p := range rec.got[id] {
			switch {
			case strings.HasPrefix(p, "old "):
				oldPub = append(oldPub, strings.TrimPrefix(p, "old "))
			case p != "new":
				client = append(client, p)
			}
		}
		for _, seqs := range [][]string{client, oldPub} {
			for j, s := range seqs {
				if s != strconv.Itoa(j+1) {
					t.Fatalf("entity %s handled %v: not each once in order", id, seqs)
				}
			}
		}
	}
}

// handledAll reports whether every entity handled what both publishers
// sent it.
func handledAll(rec *counting, sent map[string]int) bool {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for id, n := range sent {
		olds := 0
		for _, p := range rec.got[id] {
			if strings.HasPrefix(p, "old ") {
				olds++
			}
		}
		if olds < n {
			return false
		}
	}
	return true
}

// TestReshardDurable (issue 35, durable delivery): a kv type of durable
// delivery, 8 shards on three nodes, under load from a publisher that
// keeps the count of 8 throughout (JetStream publishes, a key on every
// other message) and natshard.Client (a key on every other message), is
// split to 16; a child moves to another node; a node crashes; then a
// second split, to 64. Each entity's array holds every message of each
// publisher once, in the order it was published: nothing lost, nothing
// applied twice (the parents' owners forward to the children; the kv
// entity's applied sequence skips what it applied), order per publisher.
func TestReshardDurable(t *testing.T) {
	typ := natshard.Type{Name: "rsd", Kind: "kv", Shards: 8, Delivery: natshard.Durable, Entity: entities.KV(nil)}
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 3, Types: []natshard.Type{typ}})
	subjects := protocol.MustSubjects("", "", "rsd")
	ids := entityIDs(60)
	js := natstest.JetStream(t, natstest.Connect(t, c.URL()))
	client := c.Client()
	body := func(pub string, seq int) []byte {
		return fmt.Appendf(nil, `{"op":"append","key":"l","value":"%s-%d"}`, pub, seq)
	}
	pubs := map[string]func(id string, seq int) error{
		"old": func(id string, seq int) error {
			m := nats.NewMsg(subjects.EntityOf(id, 8))
			m.Data = body("old", seq)
			if seq%2 == 0 {
				m.Header.Set(protocol.HeaderMsgID, fmt.Sprintf("old/%s/%d", id, seq))
			}
			_, err := js.PublishMsg(context.Background(), m)
			return err
		},
		"client": func(id string, seq int) error {
			var opts []natshard.SendOption
			if seq%2 == 0 {
				opts = append(opts, natshard.MsgID(fmt.Sprintf("client/%s/%d", id, seq)))
			}
			return client.Publish(context.Background(), "rsd", id, body("client", seq), opts...)
		},
	}
	sent := map[string][]int{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	const lanes = 4 // goroutines per publisher, each with its own entities
	for name, send := range pubs {
		n := make([]int, len(ids))
		sent[name] = n
		for lane := range lanes {
			wg.Go(func() {
				for i := lane; ; i += lanes {
					select {
					case <-stop:
						return
					default:
					}
					e := i % len(ids)
					if err := send(ids[e], n[e]+1); err != nil {
						t.Errorf("publisher %s: %v", name, err)
						return
					}
					n[e]++
				}
			})
		}
	}
	ctx := t.Context()
	pause := func() { time.Sleep(500 * time.Millisecond) } // lets load flow between the steps
	pause()
	if from, err := natshard.Reshard(ctx, natstest.Connect(t, c.URL()), "rsd", 16); err != nil || from != 8 {
		t.Fatalf("Reshard = %d, %v", from, err)
	}
	c.Settle()
	pause()
	child := protocol.ShardOf(ids[0], 16)
	if child < 8 {
		child += 8
	}
	c.Move("rsd", child, (c.Owner("rsd", child)+1)%3)
	pause()
	c.Crash(1)
	c.Settle()
	pause()
	if from, err := c.Node(0).Reshard(ctx, "rsd", 64); err != nil || from != 16 {
		t.Fatalf("second Reshard = %d, %v", from, err)
	}
	c.Settle()
	pause()
	close(stop)
	wg.Wait()
	if t.Failed() {
		return
	}
	if oldSubject(c, "rsd") == 0 {
		t.Errorf("no message forwarded from an old subject")
	}
	want := func(id string, e int) error {
		data, err := client.Request(ctx, "rsd", id, []byte(`{"op":"get","key":"l"}`))
		if err != nil {
			return err
		}
		var got struct{ Value []string }
		if err := json.Unmarshal(data, &got); err != nil {
			return fmt.Errorf("%s: %w", data, err)
		}
		next := map[string]int{}
		for _, v := range got.Value {
			pub, seq, _ := strings.Cut(v, "-")
			n, _ := strconv.Atoi(seq)
			if n != next[pub]+1 {
				return fmt.Errorf("%s's message %d applied after %d (lost, twice or out of order): %v", pub, n, next[pub], got.Value)
			}
			next[pub] = n
		}
		for pub, n := range sent {
			if next[pub] != n[e] {
				return fmt.Errorf("%d of %s's %d messages applied", next[pub], pub, n[e])
			}
		}
		return nil
	}
	for e, id := range ids {
		var last error
		natstest.Eventually(t, time.Minute, "entity "+id+" to apply every message once, in order", func() error {
			last = want(id, e)
			if last != nil && strings.Contains(last.Error(), "after") {
				return nil // settled wrong: fail below
			}
			return last
		})
		if last != nil {
			t.Fatalf("entity %s: %v", id, last)
		}
	}
	var total int
	for _, n := range sent {
		for _, k := range n {
			total += k
		}
	}
	t.Logf("%d messages to %d entities, %d forwarded from old subjects", total, len(ids), oldSubject(c, "rsd"))
}
