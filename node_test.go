package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

var quiet = slog.New(slog.DiscardHandler)

// envEntity answers every message with what its Env says.
type envEntity struct{ env natshard.Env }

func newEnvEntity(ctx context.Context, _ string) (natshard.Entity, error) {
	return &envEntity{env: *natshard.EnvFrom(ctx)}, nil
}

func (e *envEntity) Handle(_ context.Context, m *natshard.Message) ([]byte, error) {
	if string(m.Data) == "fail" {
		return nil, errors.New("asked to fail")
	}
	return fmt.Appendf(nil, "%s %s %d %s %s", e.env.Type, e.env.ID, e.env.Shard, e.env.Region, m.Data), nil
}

func (e *envEntity) Stop(context.Context) error { return nil }

// startOn starts a node against the server at url.
func startOn(t *testing.T, url, region string, types ...natshard.Type) (*natshard.Node, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: region, Logger: quiet}, types...)
	if err == nil {
		t.Cleanup(func() { _ = n.Close(context.Background()) })
	}
	return n, err
}

func mustStartOn(t *testing.T, url, region string, types ...natshard.Type) *natshard.Node {
	t.Helper()
	n, err := startOn(t, url, region, types...)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestEmbeddedTwoTypes: one Start with an embedded server hosts two types
// on one connection; the client reaches both; each entity sees its Env;
// an entity's error comes back typed; Stop ends it.
func TestEmbeddedTwoTypes(t *testing.T) {
	ctx := context.Background()
	node, err := natshard.Start(ctx, natshard.Options{
		Server: natshard.ServerOptions{Listen: "127.0.0.1:0", DataDir: t.TempDir()},
		Region: "solo", Logger: quiet,
	}, natshard.Type{Name: "alpha", Entity: newEnvEntity, Shards: 8}, natshard.Type{Name: "beta", Entity: newEnvEntity})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(node.ClientURL(), "nats://127.0.0.1:") {
		t.Fatalf("ClientURL %q", node.ClientURL())
	}
	// Another process's client: it learns the shard counts from KV.
	c := natshard.NewClient(natstest.Connect(t, node.ClientURL()))
	for _, tc := range []struct {
		typ    string
		shards int
	}{{"alpha", 8}, {"beta", natshard.DefaultShards}} {
		got, err := c.Request(ctx, tc.typ, "order.42", []byte("hi"))
		want := fmt.Sprintf("%s order.42 %d solo hi", tc.typ, protocol.ShardOf("order.42", tc.shards))
		if err != nil || string(got) != want {
			t.Fatalf("%s: %q, %v; want %q", tc.typ, got, err, want)
		}
	}
	_, err = c.Entity("alpha", "x").Request(ctx, []byte("fail"))
	var ee *natshard.EntityError
	if !errors.As(err, &ee) || ee.Message != "asked to fail" || ee.Type != "alpha" || ee.ID != "x" {
		t.Fatalf("entity error: %v", err)
	}
	if _, err := c.Request(ctx, "gamma", "x", nil); !errors.Is(err, natshard.ErrUnknownType) {
		t.Fatalf("unknown type: %v", err)
	}
	if _, err := c.Request(ctx, "alpha", "bad id", nil); err == nil {
		t.Fatal("a bad entity id was sent")
	}
	if err := node.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := node.Stop(ctx); !errors.Is(err, natshard.ErrClosed) {
		t.Fatalf("second Stop: %v", err)
	}
	select {
	case <-node.Done():
	default:
		t.Fatal("Done open after Stop")
	}
	if node.Err() != nil {
		t.Fatalf("Err after Stop: %v", node.Err())
	}
}

// TestStartRefuses: what would corrupt a type is refused with an error
// that names both sides.
func TestStartRefuses(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	cs := "consistent-hashing:virtual-nodes=100,limit=4"
	mustStartOn(t, url, "a", natshard.Type{Name: "orders", Kind: "cart", Entity: newEnvEntity, Shards: 16, Strategy: cs})
	for _, tc := range []struct {
		name string
		typ  natshard.Type
		want string
	}{
		{"kind", natshard.Type{Name: "orders", Kind: "echo"}, `this process hosts entity kind "echo", the type's entities are of kind "cart"`},
		{"default kind", natshard.Type{Name: "orders"}, `entity kind "orders", the type's entities are of kind "cart"`},
		{"shards", natshard.Type{Name: "orders", Kind: "cart", Shards: 32}, "32 shards disagree with the 16 stored"},
		{"strategy", natshard.Type{Name: "orders", Kind: "cart", Strategy: "least-shard"}, `strategy "least-shard:absolute=65536,relative=1" disagrees with the type's stored strategy "consistent-hashing:virtual-nodes=100,limit=4"`},
	} {
		tc.typ.Entity = newEnvEntity
		_, err := startOn(t, url, "b", tc.typ)
		if !errors.Is(err, natshard.ErrConfigMismatch) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want ErrConfigMismatch saying %q", tc.name, err, tc.want)
		}
	}
	// A second process with the region id of a live one.
	_, err := startOn(t, url, "a", natshard.Type{Name: "orders", Kind: "cart", Entity: newEnvEntity})
	if !errors.Is(err, natshard.ErrRegionInUse) {
		t.Errorf("region a twice: %v; want ErrRegionInUse", err)
	}
	// Bad options and types, before anything connects.
	for _, tc := range []struct {
		opts natshard.Options
		typ  natshard.Type
		want string
	}{
		{natshard.Options{NATS: url}, natshard.Type{Name: "x"}, "Entity: the factory is required"},
		{natshard.Options{NATS: url}, natshard.Type{Name: "a.b", Entity: newEnvEntity}, "Name"},
		{natshard.Options{NATS: url}, natshard.Type{Name: "x", Entity: newEnvEntity, Strategy: "random"}, "Strategy"},
		{natshard.Options{NATS: url}, natshard.Type{Name: "x", Entity: newEnvEntity, IdleTimeout: -time.Second}, "IdleTimeout"},
		{natshard.Options{NATS: url, LeaseTTL: 1500 * time.Millisecond}, natshard.Type{Name: "x", Entity: newEnvEntity}, "LeaseTTL"},
		{natshard.Options{NATS: url, Region: "a b"}, natshard.Type{Name: "x", Entity: newEnvEntity}, "Region"},
		{natshard.Options{NATS: url, Server: natshard.ServerOptions{AuthDir: "/x"}}, natshard.Type{Name: "x", Entity: newEnvEntity}, "Server"},
		{natshard.Options{NATS: "nats://127.0.0.1:1"}, natshard.Type{Name: "x", Entity: newEnvEntity}, "cannot connect to NATS at nats://127.0.0.1:1"},
	} {
		tc.opts.Logger = quiet
		if _, err := natshard.Start(context.Background(), tc.opts, tc.typ); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v %+v: %v; want an error naming %q", tc.opts, tc.typ, err, tc.want)
		}
	}
}

// TestStoredConfigAdopted: a Type that leaves the shard count, strategy
// and kind zero hosts the type as stored, and the other fields get the
// library's defaults; Defaults shows what a new type gets.
func TestStoredConfigAdopted(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	cs := "consistent-hashing:virtual-nodes=100,limit=4"
	mustStartOn(t, url, "a", natshard.Type{Name: "orders", Kind: "cart", Entity: newEnvEntity, Shards: 16, Strategy: cs})
	n := mustStartOn(t, url, "b", natshard.Type{Name: "orders", Kind: "cart", Entity: newEnvEntity})
	got, ok := n.Type("orders")
	if !ok {
		t.Fatal("Type(orders) unknown")
	}
	got.Entity = nil
	want := natshard.Type{Name: "orders", Kind: "cart", Shards: 16, Strategy: cs}.Defaults()
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("hosted as\n%+v\nwant\n%+v", got, want)
	}
	d := natshard.Type{Name: "new"}.Defaults()
	if d.Kind != "new" || d.Shards != natshard.DefaultShards || d.Strategy != natshard.DefaultStrategy ||
		d.IdleTimeout != natshard.DefaultIdleTimeout || d.BufferSize != natshard.DefaultBufferSize {
		t.Fatalf("Defaults() = %+v", d)
	}
	// The lease TTL and grace chosen for a standalone server.
	if o := n.Options(); o.LeaseTTL != natshard.StandaloneLeaseTTL || o.ReleaseGrace != natshard.Off {
		t.Fatalf("standalone server: lease TTL %v, grace %v", o.LeaseTTL, o.ReleaseGrace)
	}
}

// TestClusterLeaseAndGrace: on a NATS cluster the node chooses the lease
// TTL that outlives a JetStream leader election, and the release grace.
func TestClusterLeaseAndGrace(t *testing.T) {
	servers := natstest.RunCluster(t, 3)
	n := mustStartOn(t, natstest.URL(servers[0]), "a", natshard.Type{Name: "t", Entity: newEnvEntity, Shards: 4, Replicas: 3})
	if o := n.Options(); o.LeaseTTL != natshard.ClusterLeaseTTL || o.ReleaseGrace != natshard.ClusterReleaseGrace {
		t.Fatalf("cluster: lease TTL %v, grace %v", o.LeaseTTL, o.ReleaseGrace)
	}
}

// TestCallersConnection: with a connection the caller owns, the node
// suspends its regions when the connection drops and, once it is back,
// renews their registration naming the new connection and serves again
// (the same incarnation: nothing fenced), leaves the caller's own handlers alone,
// leaves the connection open when it stops, and ends (ErrConnectionClosed)
// when the caller closes it.
func TestCallersConnection(t *testing.T) {
	opts := natstest.DefaultOptions(t)
	opts.Port = natstest.FreePorts(t, 1)[0]
	srv := natstest.RunServerWithOptions(t, opts)
	var disconnects sync.WaitGroup
	disconnects.Add(1)
	var once sync.Once
	nc, err := nats.Connect(natstest.URL(srv), append(natshard.ConnectOptions(),
		nats.DisconnectErrHandler(func(*nats.Conn, error) { once.Do(disconnects.Done) }))...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx := context.Background()
	node, err := natshard.Start(ctx, natshard.Options{Conn: nc, Region: "mine", Logger: quiet}, natshard.Type{Name: "t", Entity: newEnvEntity, Shards: 4})
	if err != nil {
		t.Fatal(err)
	}
	store := typeStore(t, natstest.URL(srv), "t")
	before := registered(t, store, "mine")

	// The server restarts: the node suspends the region, which renews its
	// registration, naming its new connection, once back.
	natstest.Shutdown(srv)
	disconnects.Wait() // the caller's handler still runs
	srv = natstest.RunServerWithOptions(t, opts)
	store = typeStore(t, natstest.URL(srv), "t")
	natstest.Eventually(t, 20*time.Second, "the region to renew its registration with its new connection", func() error {
		now := registered(t, store, "mine")
		if now.Conn == before.Conn || now.Conn.IsZero() {
			return fmt.Errorf("registered %+v, was %+v", now, before)
		}
		if now.Incarnation != before.Incarnation {
			t.Fatalf("the region registered a new incarnation (it fenced): %+v, was %+v", now, before)
		}
		return nil
	})
	if got, err := natshard.NewClient(nc).Request(ctx, "t", "x", []byte("back")); err != nil || !strings.HasSuffix(string(got), "back") {
		t.Fatalf("after the reconnect: %q, %v", got, err)
	}

	if err := node.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if !nc.IsConnected() {
		t.Fatal("Stop closed the caller's connection")
	}

	// A node whose caller closes the connection ends.
	node, err = natshard.Start(ctx, natshard.Options{Conn: nc, Region: "mine", Logger: quiet}, natshard.Type{Name: "t", Entity: newEnvEntity})
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	select {
	case <-node.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the node did not end when its connection was closed")
	}
	if !errors.Is(node.Err(), natshard.ErrConnectionClosed) {
		t.Fatalf("Err %v", node.Err())
	}
	_ = node.Close(ctx)
}

func typeStore(t *testing.T, url, typ string) *kvstate.Store {
	t.Helper()
	store, err := kvstate.Bind(context.Background(), natstest.JetStream(t, natstest.Connect(t, url)), typ, kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return store
}

// registration is the incarnation registered for region id ("" none).
func registration(t *testing.T, store *kvstate.Store, id string) string {
	t.Helper()
	return registered(t, store, id).Incarnation
}

// registered is region id's registration; zero when it has none.
func registered(t *testing.T, store *kvstate.Store, id string) protocol.RegionInfo {
	t.Helper()
	info, _, err := store.Region(context.Background(), id)
	if err != nil {
		return protocol.RegionInfo{}
	}
	return info
}

// blockingEntity's Handle waits for its context to end.
type blockingEntity struct{ entered chan<- context.Context }

func (e blockingEntity) Handle(ctx context.Context, _ *natshard.Message) ([]byte, error) {
	e.entered <- ctx
	<-ctx.Done()
	return nil, ctx.Err()
}
func (blockingEntity) Stop(context.Context) error { return nil }

// TestHandleContextEndsOnClose: an entity's context ends when the node
// closes, so that work on a shard this process no longer serves stops.
func TestHandleContextEndsOnClose(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	entered := make(chan context.Context, 1)
	n := mustStartOn(t, url, "a", natshard.Type{Name: "t", Shards: 1,
		Entity: func(context.Context, string) (natshard.Entity, error) { return blockingEntity{entered}, nil }})
	// A request, retried until the shard is allocated (a publish sent
	// before then would reach nobody).
	go func() {
		_, _ = natshard.NewClient(natstest.Connect(t, url)).Request(context.Background(), "t", "x", nil)
	}()
	var ctx context.Context
	select {
	case ctx = <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the entity never got its message")
	}
	if ctx.Err() != nil {
		t.Fatalf("context ended early: %v", ctx.Err())
	}
	_ = n.Close(context.Background())
	if ctx.Err() == nil {
		t.Fatal("the entity's context lives on after Close")
	}
}

// TestRunStopsOnContext: Run serves until its context ends and returns
// nil after a graceful stop.
func TestRunStopsOnContext(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- natshard.Run(ctx, natshard.Options{NATS: url, Region: "r", Logger: quiet}, natshard.Type{Name: "t", Entity: newEnvEntity, Shards: 2})
	}()
	c := natshard.NewClient(natstest.Connect(t, url))
	natstest.Eventually(t, 30*time.Second, "an answer once Run has started", func() error {
		got, err := c.Request(context.Background(), "t", "x", []byte("up"))
		if err == nil && strings.HasSuffix(string(got), "up") {
			return nil
		}
		if !errors.Is(err, natshard.ErrUnknownType) {
			t.Fatalf("%q, %v", got, err) // the type exists once Run has started
		}
		return err
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Run did not return")
	}
	store := typeStore(t, url, "t")
	if inc := registration(t, store, "r"); inc != "" {
		t.Fatalf("region still registered after Run returned (%s)", inc)
	}
}

// TestStateStore: Node.StateStore is the store a type's entities get in
// their Env, there before any entity activated; an unknown type has none.
func TestStateStore(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	saver := func(ctx context.Context, id string) (natshard.Entity, error) {
		env := natshard.EnvFrom(ctx)
		_, err := env.Store.SaveEntity(ctx, id, []byte("from "+id), 0)
		return &envEntity{env: *env}, err
	}
	n := mustStartOn(t, url, "a", natshard.Type{Name: "docs", Entity: saver, Shards: 4})
	store, ok := n.StateStore("docs")
	if !ok {
		t.Fatal("StateStore(docs) unknown")
	}
	ctx := context.Background()
	if _, _, err := store.LoadEntity(ctx, "x"); !errors.Is(err, natshard.ErrNotFound) {
		t.Fatalf("before any activation: %v, want ErrNotFound", err)
	}
	if _, err := n.Client().Request(ctx, "docs", "x", nil); err != nil {
		t.Fatal(err)
	}
	if data, rev, err := store.LoadEntity(ctx, "x"); err != nil || string(data) != "from x" || rev == 0 {
		t.Fatalf("saved by the entity: %q at %d, %v", data, rev, err)
	}
	if _, ok := n.StateStore("nope"); ok {
		t.Fatal("StateStore of a type the node does not host")
	}
}

// TestMaxActive: a region with Type.MaxActive holds at most that many
// idle entities; the default policy (W-TinyLFU) keeps the one used often
// and passivates newcomers used once, their passivations are counted,
// and a passivated entity comes back on its next message.
func TestMaxActive(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	n := mustStartOn(t, url, "a", natshard.Type{Name: "t", Shards: 4, MaxActive: 50, Entity: newEnvEntity})
	c := natshard.NewClient(natstest.Connect(t, url))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range 5 {
		if _, err := c.Request(ctx, "t", "e0", nil); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i < 200; i++ {
		if _, err := c.Request(ctx, "t", fmt.Sprintf("e%d", i), nil); err != nil {
			t.Fatal(err)
		}
	}
	var st natshard.Stats
	natstest.Eventually(t, 20*time.Second, "at most 50 entities active (MaxActive)", func() error {
		st, _ = n.Stats("t")
		if st.Entities > 50 {
			return fmt.Errorf("%d active", st.Entities)
		}
		return nil
	})
	if st.OverLimit < 150 || st.Passivations < st.OverLimit || st.Activations != 200 {
		t.Fatalf("activations %d, passivations %d, over the limit %d: want 200 activations and at least 150 passivated for the limit", st.Activations, st.Passivations, st.OverLimit)
	}
	// e0 was used five times: still active.
	if _, err := c.Request(ctx, "t", "e0", nil); err != nil {
		t.Fatal(err)
	}
	if st, _ = n.Stats("t"); st.Activations != 200 {
		t.Fatalf("activations %d after a message to e0, used often, want 200 (it stayed active)", st.Activations)
	}
	// At most 49 of e1 - e199, used once each, are still active: the
	// policy (W-TinyLFU, whose sketch has a random seed) does not say
	// which. A message to one that was passivated brings it back; one of
	// e1 - e50 must be such.
	for i := 1; ; i++ {
		if i > 50 {
			t.Fatalf("e1 - e50 were all still active with MaxActive 50 and e0 active")
		}
		id := fmt.Sprintf("e%d", i)
		if data, err := c.Request(ctx, "t", id, []byte("again")); err != nil || !strings.HasSuffix(string(data), "again") {
			t.Fatalf("%s after the limit: %q %v", id, data, err)
		}
		if st, _ = n.Stats("t"); st.Activations == 201 {
			break
		} else if st.Activations != 200 {
			t.Fatalf("activations %d after a message to %s, want 200 or 201", st.Activations, id)
		}
	}
}
