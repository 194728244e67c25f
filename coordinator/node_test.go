package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

const shards = 16

// openType starts a server and opens the KV bucket and the buffer of type
// kv on it.
func openType(t *testing.T) (*nats.Conn, *kvstate.Store, *kvstate.Buffer, protocol.Subjects) {
	t.Helper()
	return openTypeOn(t, natstest.Connect(t, natstest.URL(natstest.RunServer(t))))
}

// openTypeOn opens (or binds) the KV bucket and the buffer of type kv on
// connection nc.
func openTypeOn(t *testing.T, nc *nats.Conn) (*nats.Conn, *kvstate.Store, *kvstate.Buffer, protocol.Subjects) {
	t.Helper()
	return openTypeWith(t, nc, kvstate.BufferOptions{})
}

// openTypeWith is openTypeOn with the buffer's options bopts.
func openTypeWith(t *testing.T, nc *nats.Conn, bopts kvstate.BufferOptions) (*nats.Conn, *kvstate.Store, *kvstate.Buffer, protocol.Subjects) {
	t.Helper()
	js := natstest.JetStream(t, nc)
	store, err := kvstate.Open(context.Background(), js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	subjects := protocol.MustSubjects("", "", "kv")
	buffer, err := kvstate.OpenBuffer(context.Background(), js, subjects, bopts)
	if err != nil {
		t.Fatal(err)
	}
	return nc, store, buffer, subjects
}

// openRegion opens region id on the type opened by openType, its entities
// made by factory; it closes when the test ends.
func openRegion(t *testing.T, nc *nats.Conn, store *kvstate.Store, buffer *kvstate.Buffer, subjects protocol.Subjects, id string, factory region.Factory) *region.Agent {
	t.Helper()
	return openRegionWith(t, region.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, ID: id, Factory: factory})
}

// openRegionWith is openRegion with the region's configuration cfg (its
// Shards and Logger set here).
func openRegionWith(t *testing.T, cfg region.Config) *region.Agent {
	t.Helper()
	cfg.Shards, cfg.Logger = shards, failLog(t, "region "+cfg.ID)
	agent, err := region.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Close(context.Background()) })
	return agent
}

// startCoordinator runs coordinator candidate name on the type opened by
// openType until the returned stop is called.
func startCoordinator(nc *nats.Conn, store *kvstate.Store, buffer *kvstate.Buffer, subjects protocol.Subjects, name string) (stop func()) {
	return runNode(coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: name})
}

// runNode runs a coordinator candidate with cfg until stop is called,
// which returns once the candidate has stopped.
func runNode(cfg coordinator.Config) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		coordinator.New(cfg).Run(ctx)
	}()
	return func() { cancel(); <-done }
}

// failLog is a logger for a node or region of t, named who: what it
// logs (at info: debug logs each parked message, which would slow the
// node) is printed if t fails, so that a failure that came of the timing
// of a loaded machine can be read afterwards.
func failLog(t *testing.T, who string) *slog.Logger {
	var logs natstest.Buffer
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the %s's log:\n%s", who, logs.String())
		}
	})
	return slog.New(slog.NewTextHandler(&logs, nil))
}

func status(nc *nats.Conn, s protocol.Subjects) (protocol.Status, error) {
	var st protocol.Status
	m, err := nc.Request(s.Admin(protocol.AdminStatus), nil, time.Second)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(m.Data, &st)
}

// TestGracefulHandover: two candidates, one leader; the leader stops, its
// lease is released (not left to expire), the other leads with a newer
// epoch and keeps every shard where it was.
func TestGracefulHandover(t *testing.T) {
	nc, store, buffer, subjects := openType(t)
	ctx := context.Background()
	openRegion(t, nc, store, buffer, subjects, "r1", entities.Echo())

	// A long TTL: a takeover within the test's deadline proves a release.
	const ttl = 30 * time.Second
	start := func(name string) func() {
		return runNode(coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: name, LeaseTTL: ttl})
	}
	cands := map[string]func(){"c1": start("c1"), "c2": start("c2")}
	defer func() {
		for _, stop := range cands {
			stop()
		}
	}()
	var first protocol.Status
	natstest.Eventually(t, 20*time.Second, "all shards active", func() error {
		var err error
		if first, err = status(nc, subjects); err != nil {
			return err
		}
		for _, s := range first.Table {
			if s.State != "active" || s.Region != "r1" {
				return fmt.Errorf("shard %d %s on %q", s.Shard, s.State, s.Region)
			}
		}
		return nil
	})
	info, _, err := store.Coordinator(ctx)
	if err != nil || info.Region != first.Coordinator.Region {
		t.Fatalf("lease holder %q, status says %q (%v)", info.Region, first.Coordinator.Region, err)
	}
	leader := first.Coordinator.Region
	other := map[string]string{"c1": "c2", "c2": "c1"}[leader]

	cands[leader]()
	var next protocol.Status
	natstest.Eventually(t, 20*time.Second, "the other candidate leads", func() error {
		var err error
		if next, err = status(nc, subjects); err != nil {
			return err
		}
		if next.Coordinator.Region != other || next.Coordinator.Epoch <= first.Coordinator.Epoch {
			return fmt.Errorf("coordinator %s epoch %d", next.Coordinator.Region, next.Coordinator.Epoch)
		}
		return nil
	})
	for i, s := range next.Table {
		if s != first.Table[i] {
			t.Errorf("shard %d changed across the handover: %+v -> %+v", i, first.Table[i], s)
		}
	}
}

// TestDeposedCoordinatorCannotWrite: once another holds the lease, a write
// fenced on the old lease is refused by the server.
func TestDeposedCoordinatorCannotWrite(t *testing.T) {
	srv := natstest.RunServer(t)
	nc := natstest.Connect(t, natstest.URL(srv))
	ctx := context.Background()
	store, err := kvstate.Open(ctx, natstest.JetStream(t, nc), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	old, err := store.AcquireCoordinator(ctx, protocol.CoordinatorInfo{Region: "old"}, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.PutShard(ctx, old, protocol.ShardRecord{Shard: 1, Region: "a", State: protocol.StateActive, Epoch: old.Revision}); err != nil {
		t.Fatalf("holder's write: %v", err)
	}
	if err := store.DeposeCoordinator(ctx, old.Revision); err != nil {
		t.Fatal(err)
	}
	fresh, err := store.AcquireCoordinator(ctx, protocol.CoordinatorInfo{Region: "new"}, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_, err = store.PutShard(ctx, old, protocol.ShardRecord{Shard: 1, Region: "b", State: protocol.StateActive, Epoch: old.Revision})
	if !errors.Is(err, kvstate.ErrFenced) {
		t.Fatalf("deposed write: %v, want ErrFenced", err)
	}
	if _, err := store.PutShard(ctx, fresh, protocol.ShardRecord{Shard: 1, Region: "c", State: protocol.StateActive, Epoch: fresh.Revision}); err != nil {
		t.Fatalf("new holder's write: %v", err)
	}
	rows, err := store.Shards(ctx)
	if err != nil || len(rows) != 1 || rows[0].Region != "c" {
		t.Fatalf("table %+v %v", rows, err)
	}
}

// recorder is an entity factory that records what each entity handled.
type recorder struct {
	mu  sync.Mutex
	got map[string][]string
}

func (r *recorder) factory(_ context.Context, id string) (region.Entity, error) {
	return recEntity{r: r, id: id}, nil
}

type recEntity struct {
	r  *recorder
	id string
}

func (e recEntity) Handle(_ context.Context, m *region.Message) ([]byte, error) {
	e.r.mu.Lock()
	defer e.r.mu.Unlock()
	e.r.got[e.id] = append(e.r.got[e.id], string(m.Data))
	return m.Data, nil
}

func (recEntity) Stop(context.Context) error { return nil }

// TestParkedUntilFirstRegion: with a coordinator and no region at all,
// published messages wait in the buffer (docs/PROTOCOL.md, "Handoff": Parking)
// and are processed, in order, when the first region comes; a request sent
// while no region exists is answered then.
func TestParkedUntilFirstRegion(t *testing.T) {
	nc, store, buffer, subjects := openType(t)
	defer runNode(coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "c"})()
	natstest.Eventually(t, 20*time.Second, "every shard parked", func() error {
		st, err := status(nc, subjects)
		if err != nil {
			return err
		}
		for _, s := range st.Table {
			if s.State != "parked" {
				return fmt.Errorf("shard %d is %s", s.Shard, s.State)
			}
		}
		return nil
	})

	const entities, per = 20, 25
	for i := range per {
		for e := range entities {
			id := fmt.Sprintf("e-%d", e)
			if err := nc.Publish(subjects.EntityOf(id, shards), []byte(fmt.Sprint(i))); err != nil {
				t.Fatal(err)
			}
		}
	}
	reply := nats.NewInbox()
	answers, err := nc.SubscribeSync(reply)
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.PublishRequest(subjects.EntityOf("asker", shards), reply, []byte("waiting")); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	rec := &recorder{got: map[string][]string{}}
	openRegion(t, nc, store, buffer, subjects, "first", rec.factory)
	m, err := answers.NextMsg(20 * time.Second)
	if err != nil || string(m.Data) != "waiting" {
		t.Fatalf("the request sent with no region: %v", err)
	}
	natstest.Eventually(t, 20*time.Second, "every parked message handled", func() error {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		for e := range entities {
			if got := len(rec.got[fmt.Sprintf("e-%d", e)]); got != per {
				return fmt.Errorf("entity e-%d handled %d of %d", e, got, per)
			}
		}
		return nil
	})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for e := range entities {
		for i, v := range rec.got[fmt.Sprintf("e-%d", e)] {
			if v != fmt.Sprint(i) {
				t.Fatalf("entity e-%d: message %d is %q: out of order", e, i, v)
			}
		}
	}
}

// TestParkedShardsFullBuffer (issue 30, core seed 97 of the fault
// campaign): a parked shard's buffer that refuses a message (full here;
// out of space in the campaign) makes the coordinator refuse it only
// while nobody else holds the shard. Once the shard's new owner is bound
// (subscribed, holding what arrives until the end marker), the parking
// goes on for the release grace, and the owner holds its own copy of each
// message the buffer refuses and handles it: a refusal then would tell the
// requester that a message that is handled was not ("phantom").
func TestParkedShardsFullBuffer(t *testing.T) {
	srv := natstest.RunServer(t)
	nc, store, buffer, subjects := openTypeWith(t, natstest.Connect(t, natstest.URL(srv)), kvstate.BufferOptions{MaxPerShard: 2})
	defer runNode(coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "c",
		ReleaseGrace: 10 * time.Second, Logger: failLog(t, "node")})()
	waitRows(t, nc, subjects, "every shard parked", string(protocol.StateParked), "")

	const id = "e0"
	subject := subjects.EntityOf(id, shards)
	shard := protocol.ShardOf(id, shards)
	for _, v := range []string{"1", "2"} {
		if err := nc.Publish(subject, []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Eventually(t, 20*time.Second, "the shard's buffer full", func() error {
		if err := buffer.Flush(context.Background()); err != nil {
			return err
		}
		if n, err := buffer.Len(context.Background(), shard); err != nil || n != 2 {
			return fmt.Errorf("%d messages buffered (%v)", n, err)
		}
		return nil
	})
	// No region: the coordinator alone has the message, and says it was
	// not handled.
	m, err := nc.Request(subject, []byte("3"), 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(protocol.HeaderRefused) != protocol.RefusedMoving {
		t.Fatalf("a parked shard's full buffer: answered %q (headers %v), want refused %q", m.Data, m.Header, protocol.RefusedMoving)
	}

	// A region is bound; until the release grace ends (10 s: the test must
	// see both subscriptions and send within it, on a loaded machine too)
	// both it and the parking have the shard's messages.
	rec := &recorder{got: map[string][]string{}}
	openRegion(t, nc, store, buffer, subjects, "r1", rec.factory)
	natstest.Eventually(t, 20*time.Second, "the region and the parking subscribed to the shard", func() error {
		if n := srv.GlobalAccount().Interest(subject); n < 2 {
			return fmt.Errorf("%d subscriptions", n)
		}
		return nil
	})
	m, err = nc.Request(subject, []byte("4"), 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if r := m.Header.Get(protocol.HeaderRefused); r != "" || string(m.Data) != "4" {
		t.Fatalf("a message the bound region holds: answered %q, refused %q (%s)", m.Data, r, m.Header.Get(protocol.HeaderError))
	}
	rec.waitLast(t, 4, id)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if got := rec.got[id]; !slices.Equal(got, []string{"1", "2", "4"}) {
		t.Fatalf("handled %v, want [1 2 4]: the refused 3 not, the others once each, in order", got)
	}
}
