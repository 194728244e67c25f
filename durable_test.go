package natshard_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// counter is an in-memory entity (at least once after a crash): it
// records every message it handles, for the test to count.
type counter struct {
	id  string
	log *handledLog
}

type handledLog struct {
	mu   sync.Mutex
	seen map[string][]string // entity -> payloads in the order handled
}

func (l *handledLog) add(id, data string) {
	l.mu.Lock()
	l.seen[id] = append(l.seen[id], data)
	l.mu.Unlock()
}

func (c *counter) Handle(_ context.Context, m *natshard.Message) ([]byte, error) {
	c.log.add(c.id, string(m.Data))
	return m.Data, nil
}
func (*counter) Stop(context.Context) error { return nil }

// durableNode starts a node of type typ of durable delivery on a
// connection of its own.
func durableNode(t *testing.T, url, region string, typ natshard.Type) *natshard.Node {
	t.Helper()
	typ.Delivery = natshard.Durable
	nc, err := nats.Connect(url, natshard.ConnectOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	n, err := natshard.Start(context.Background(), natshard.Options{Conn: nc, Region: region, Logger: quiet}, typ)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	return n
}

// publishAll publishes n messages to each entity through the stream,
// without Nats-Msg-Id, in per-entity order, and returns when all are
// stored.
func publishAll(t *testing.T, js jetstream.JetStream, subjects protocol.Subjects, shards int, ids []string, n int, body func(i int) string) {
	t.Helper()
	for i := range n {
		for _, id := range ids {
			if _, err := js.Publish(context.Background(), subjects.EntityOf(id, shards), []byte(body(i))); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func entityIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("e%d", i)
	}
	return ids
}

// waitHandled waits until every entity handled want messages.
func waitHandled(t *testing.T, l *handledLog, ids []string, want int) {
	t.Helper()
	natstest.Eventually(t, time.Minute, fmt.Sprintf("every entity to handle %d messages", want), func() error {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, id := range ids {
			if len(l.seen[id]) < want {
				return fmt.Errorf("entity %s handled %d", id, len(l.seen[id]))
			}
		}
		return nil
	})
}

// TestDurablePlannedMoves (docs/FAULTS.md, "Guarantees": planned moves in
// durable delivery): through a join (rebalance) and a graceful stop, every
// message, published without Nats-Msg-Id, is handled exactly once, in order
// per entity, by in-memory entities; on one server, and on a three-server
// cluster with an R3 stream, where an acknowledgement removes its message a
// moment after it is confirmed (the source waits for the removal before it
// reports the shard stopped).
func TestDurablePlannedMoves(t *testing.T) {
	t.Run("R1", func(t *testing.T) { testDurablePlannedMoves(t, natstest.URL(natstest.RunServer(t)), 1) })
	t.Run("R3", func(t *testing.T) { testDurablePlannedMoves(t, natstest.ClusterURLs(natstest.RunCluster(t, 3)), 3) })
}

func testDurablePlannedMoves(t *testing.T, url string, replicas int) {
	log := &handledLog{seen: map[string][]string{}}
	typ := natshard.Type{Name: "d", Shards: 8, Replicas: replicas, Entity: func(_ context.Context, id string) (natshard.Entity, error) {
		return &counter{id: id, log: log}, nil
	}}
	a := durableNode(t, url, "a", typ)
	if got, _ := a.Type("d"); got.Delivery != natshard.Durable {
		t.Fatalf("hosted with delivery %q", got.Delivery)
	}
	js := natstest.JetStream(t, natstest.Connect(t, url))
	subjects := protocol.MustSubjects("", "", "d")
	ids := entityIDs(40)
	const rounds = 100
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range rounds {
			publishAll(t, js, subjects, 8, ids, 1, func(int) string { return fmt.Sprint(i) })
			time.Sleep(10 * time.Millisecond)
		}
	}()
	waitHandled(t, log, ids, 1)        // a serves under load
	b := durableNode(t, url, "b", typ) // a join: shards move to b
	natstest.Eventually(t, 30*time.Second, "b to handle messages: shards moved to it under load", func() bool {
		st, _ := b.Stats("d")
		return st.Delivered > 100
	})
	if err := b.Stop(context.Background()); err != nil { // a leave: they move back
		t.Fatal(err)
	}
	<-done
	// A last message to each entity, after all others: a copy of an
	// earlier one that was to come comes before it is handled.
	publishAll(t, js, subjects, 8, ids, 1, func(int) string { return "end" })
	waitHandled(t, log, ids, rounds+1)
	log.mu.Lock()
	defer log.mu.Unlock()
	for _, id := range ids {
		got := log.seen[id]
		want := make([]string, rounds, rounds+1)
		for i := range want {
			want[i] = fmt.Sprint(i)
		}
		want = append(want, "end")
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("entity %s handled %v, want each of 0..%d once, in order, then end", id, got, rounds-1)
		}
	}
}

// TestDurableCrash (docs/FAULTS.md, "Guarantees": durable delivery): a
// region's process dies (its connection closes) while messages flow; nothing
// that the stream acknowledged is lost, and kv entities apply each message
// once, though the next owner gets again what the dead one had not
// acknowledged. Messages carry no Nats-Msg-Id.
func TestDurableCrash(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	typ := natshard.Type{Name: "kv", Kind: "kv", Shards: 8, Entity: entities.KV(nil)}
	durableNode(t, url, "a", typ)
	ncB, err := nats.Connect(url, natshard.ConnectOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	typB := typ
	typB.Delivery = natshard.Durable
	b, err := natshard.Start(context.Background(), natshard.Options{Conn: ncB, Region: "b", NoCoordinator: true, Logger: quiet}, typB)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	natstest.Eventually(t, 30*time.Second, "a shard on b", func() bool {
		st, _ := b.Stats("kv")
		return len(st.Shards) > 0
	})
	js := natstest.JetStream(t, natstest.Connect(t, url))
	subjects := protocol.MustSubjects("", "", "kv")
	ids := entityIDs(40)
	const rounds = 50
	done := make(chan struct{})
	go func() {
		defer close(done)
		publishAll(t, js, subjects, 8, ids, rounds, func(int) string { return `{"op":"incr","key":"n"}` })
	}()
	natstest.Eventually(t, 30*time.Second, "b to handle messages", func() bool {
		st, _ := b.Stats("kv")
		return st.Delivered > 0
	})
	ncB.Close() // b dies while messages flow: its shards go to a, which gets again what b had not acknowledged
	<-done

	c := natshard.NewClient(natstest.Connect(t, url))
	for _, id := range ids {
		natstest.Eventually(t, time.Minute, "every increment of entity "+id+" applied once", func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			data, err := c.Request(ctx, "kv", id, []byte(`{"op":"get","key":"n"}`))
			var got struct{ Value json.Number }
			if err == nil && json.Unmarshal(data, &got) == nil && got.Value == json.Number(fmt.Sprint(rounds)) {
				return nil
			}
			return fmt.Errorf("%s, %v; want n = %d", data, err, rounds)
		})
	}
}

// TestDurableRequests: in durable delivery a request is stored, then
// answered by its entity however late its shard is served, and an
// entity's error comes back typed; the stream is empty once all were
// handled.
func TestDurableRequests(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	typ := natshard.Type{Name: "kv", Kind: "kv", Shards: 4, Delivery: natshard.Durable, Entity: entities.KV(nil)}
	c := natshard.NewClient(natstest.Connect(t, url))
	// The type exists, nobody serves it yet: the request is stored and
	// waits for its answer.
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, natstest.Connect(t, url)), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.EnsureConfig(context.Background(), protocol.TypeConfig{Shards: 4, Kind: "kv", Delivery: protocol.DeliveryDurable}); err != nil {
		t.Fatal(err)
	}
	stream, err := kvstate.OpenStream(context.Background(), natstest.JetStream(t, natstest.Connect(t, url)), protocol.MustSubjects("", "", "kv"), kvstate.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	answered := make(chan error, 1)
	go func() {
		data, err := c.Request(context.Background(), "kv", "late", []byte(`{"op":"set","key":"k","value":1}`))
		if err == nil && string(data) != `{"ok":true,"value":1}` {
			err = fmt.Errorf("answer %s", data)
		}
		answered <- err
	}()
	natstest.Eventually(t, 30*time.Second, "the request stored", func() bool {
		n, err := stream.Messages(context.Background())
		return err == nil && n == 1
	})
	select {
	case err := <-answered:
		t.Fatalf("answered before any node ran: %v", err)
	default:
	}
	durableNode(t, url, "a", typ)
	if err := <-answered; err != nil {
		t.Fatal(err)
	}
	_, err = c.Request(context.Background(), "kv", "late", []byte(`{"op":"incr","key":"k","by":"x"}`))
	var ee *natshard.EntityError
	if !errors.As(err, &ee) {
		t.Fatalf("entity error: %v", err)
	}
	if err := c.Publish(context.Background(), "kv", "late", []byte(`{"op":"incr","key":"k"}`)); err != nil {
		t.Fatal(err)
	}
	data, err := c.Request(context.Background(), "kv", "late", []byte(`{"op":"get","key":"k"}`))
	if err != nil || string(data) != `{"ok":true,"value":2}` {
		t.Fatalf("after a publish: %s, %v", data, err)
	}
}

// TestDurablePublishOnAClosedConnection: a publish to a type of durable
// delivery on a closed connection fails at once with
// nats.ErrConnectionClosed. A closed connection never comes back, so it
// is not retried as JetStream's unavailability (a leader election) is:
// with the client's timeout at an hour, the retries would hold the call
// for that hour.
func TestDurablePublishOnAClosedConnection(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	typ := natshard.Type{Name: "kv", Kind: "kv", Shards: 4, Delivery: natshard.Durable, Entity: entities.KV(nil)}
	durableNode(t, url, "a", typ)
	nc := natstest.Connect(t, url)
	c := natshard.NewClient(nc, natshard.WithTimeout(time.Hour))
	incr := []byte(`{"op":"incr","key":"n"}`)
	if err := c.Publish(context.Background(), "kv", "x", incr); err != nil {
		t.Fatal(err) // the client knows the type now
	}
	nc.Close()
	done := make(chan error, 1)
	go func() { done <- c.Publish(context.Background(), "kv", "x", incr) }()
	select {
	case err := <-done:
		if !errors.Is(err, nats.ErrConnectionClosed) {
			t.Fatalf("publish on a closed connection: %v, want nats.ErrConnectionClosed", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a publish on a closed connection still waits after 30 s: it is retried as if JetStream could come back")
	}
}

// TestDurableConsumerGoneUnderItsOwner: a live shard's consumer is
// deleted while the shard table still gives the shard to its region, as
// when a consumer replacement that an earlier bind gave up on (its request
// timed out while the servers elected leaders) is carried out late
// (TestDurableCrash/server in the integration suite saw it: the shard
// stopped pulling, and a request to one of its entities waited for ever).
// The region must take a new consumer and go on.
func TestDurableConsumerGoneUnderItsOwner(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	log := &handledLog{seen: map[string][]string{}}
	typ := natshard.Type{Name: "c", Shards: 4, Entity: func(_ context.Context, id string) (natshard.Entity, error) {
		return &counter{id: id, log: log}, nil
	}}
	n := durableNode(t, url, "a", typ)
	natstest.Eventually(t, 20*time.Second, "a to hold the 4 shards", func() bool { st, _ := n.Stats("c"); return len(st.Shards) == 4 })
	js := natstest.JetStream(t, natstest.Connect(t, url))
	subjects := protocol.MustSubjects("", "", "c")
	ids := entityIDs(8)
	publishAll(t, js, subjects, 4, ids, 5, func(i int) string { return fmt.Sprint(i) })
	waitHandled(t, log, ids, 5)

	shard := protocol.ShardOf(ids[0], 4)
	// The type's messages are split over 4 streams (its first count's
	// largest divisor up to 16): the shard's is shard mod 4.
	stream := kvstate.MessageStreams("c", kvstate.MessageStreamsFor(4))[shard%4]
	if err := js.DeleteConsumer(context.Background(), stream, fmt.Sprintf("shard-%d", shard)); err != nil {
		t.Fatal(err)
	}
	publishAll(t, js, subjects, 4, ids, 5, func(i int) string { return fmt.Sprint(5 + i) })
	waitHandled(t, log, ids, 10)
}

// TestDurableServerRestart: the shard consumers are stored in memory, so a
// restart of the only NATS server loses them, with what they had delivered
// and not seen acknowledged. The region rides through the disconnect and
// replaces each consumer (it starts again at the first message of its
// shard left in the stream): every message published, before the restart
// and after, is applied once by kv entities, though some are delivered
// twice.
func TestDurableServerRestart(t *testing.T) {
	opts := natstest.DefaultOptions(t)
	opts.Port = natstest.FreePorts(t, 1)[0]
	srv := natstest.RunServerWithOptions(t, opts)
	url := natstest.URL(srv)
	typ := natshard.Type{Name: "kv", Kind: "kv", Shards: 4, Entity: entities.KV(nil)}
	n := durableNode(t, url, "a", typ)
	natstest.Eventually(t, 30*time.Second, "a to hold the 4 shards", func() bool { st, _ := n.Stats("kv"); return len(st.Shards) == 4 })
	subjects := protocol.MustSubjects("", "", "kv")
	ids := entityIDs(40)
	incr := func(int) string { return `{"op":"incr","key":"n"}` }
	pub := natstest.Connect(t, url)
	publishAll(t, natstest.JetStream(t, pub), subjects, 4, ids, 50, incr)
	pub.Close()

	// The server restarts while the region handles what was published.
	natstest.Shutdown(srv)
	natstest.RunServerWithOptions(t, opts) // again, on the same port and store
	js := natstest.JetStream(t, natstest.Connect(t, url))
	publishAll(t, js, subjects, 4, ids, 10, incr)

	c := natshard.NewClient(natstest.Connect(t, url))
	for _, id := range ids {
		natstest.Eventually(t, 60*time.Second, "entity "+id+" applies every increment once", func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			data, err := c.Request(ctx, "kv", id, []byte(`{"op":"get","key":"n"}`))
			if err != nil {
				return err
			}
			var got struct{ Value json.Number }
			if err := json.Unmarshal(data, &got); err != nil {
				return err
			}
			if got.Value != "60" {
				return fmt.Errorf("n = %s, want 60", got.Value)
			}
			return nil
		})
	}
}
