package natshard_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
)

// waits records what Start tells Options.OnStartWait.
type waits struct {
	mu     sync.Mutex
	seen   []natshard.StartWait
	waited chan struct{} // closed at the first wait
	once   sync.Once
}

func newWaits() *waits { return &waits{waited: make(chan struct{})} }

func (w *waits) on(s natshard.StartWait) {
	w.mu.Lock()
	w.seen = append(w.seen, s)
	w.mu.Unlock()
	if s.Waiting() {
		w.once.Do(func() { close(w.waited) })
	}
}

func (w *waits) all() []natshard.StartWait {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]natshard.StartWait(nil), w.seen...)
}

// started is the outcome of a Start run in the background.
type started struct {
	node *natshard.Node
	err  error
}

func startAsync(ctx context.Context, t *testing.T, opts natshard.Options, types ...natshard.Type) <-chan started {
	ch := make(chan started, 1)
	go func() {
		n, err := natshard.Start(ctx, opts, types...)
		if err == nil {
			t.Cleanup(func() { _ = n.Close(context.Background()) })
		}
		ch <- started{n, err}
	}()
	return ch
}

// await waits (generously) for a Start in the background to return.
func await(t *testing.T, ch <-chan started) started {
	t.Helper()
	select {
	case s := <-ch:
		return s
	case <-time.After(3 * time.Minute):
		t.Fatal("Start did not return")
		return started{}
	}
}

// waitedFor waits (generously) until Start says it waits for JetStream.
func waitedFor(t *testing.T, w *waits, ch <-chan started) {
	t.Helper()
	select {
	case <-w.waited:
	case s := <-ch:
		t.Fatalf("Start returned (%v) before it said it waits for JetStream", s.err)
	case <-time.After(2 * time.Minute):
		t.Fatal("Start never said it waits for JetStream")
	}
}

// TestStartWaitsForJetStream: a node started on a three-server cluster of
// which one server is up (no JetStream meta leader: no majority) waits,
// saying what for, and comes up once the other two servers start, without
// a restart; a second node started at once with it comes up too.
func TestStartWaitsForJetStream(t *testing.T) {
	opts := natstest.ClusterOptions(t, 3)
	first := natstest.RunServerWithOptions(t, opts[0])
	url := natstest.URL(first)
	typ := natshard.Type{Name: "orders", Entity: newEnvEntity, Shards: 8, Replicas: 3}
	ws := []*waits{newWaits(), newWaits()}
	var chs []<-chan started
	for i, region := range []string{"a", "b"} {
		chs = append(chs, startAsync(context.Background(), t, natshard.Options{
			NATS: url, Region: region, Logger: quiet, StartTimeout: 10 * time.Minute, OnStartWait: ws[i].on,
		}, typ))
	}
	for i := range chs {
		waitedFor(t, ws[i], chs[i])
	}
	got := ws[0].all()[0]
	if got.Type != "orders" || !strings.Contains(got.What, "KV bucket natshard_orders") || !errors.Is(got.Err, kvstate.ErrUnavailable) {
		t.Errorf("first wait: %+v; want the KV bucket of orders, unavailable", got)
	}
	servers := []*server.Server{first}
	for _, o := range opts[1:] {
		servers = append(servers, natstest.RunServerWithOptions(t, o))
	}
	natstest.WaitMetaLeader(t, servers)
	for i, ch := range chs {
		s := await(t, ch)
		if s.err != nil {
			t.Fatalf("node %d: %v", i, s.err)
		}
		if all := ws[i].all(); all[len(all)-1].Waiting() {
			t.Errorf("node %d: the last wait told was %v; want the end of the wait", i, all[len(all)-1])
		}
	}
	// Both serve.
	c := natshard.NewClient(natstest.Connect(t, natstest.ClusterURLs(servers)))
	natstest.Eventually(t, time.Minute, "an answer from the type", func() error {
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		got, err := c.Request(rctx, "orders", "o-1", []byte("hi"))
		if err == nil && !strings.HasPrefix(string(got), "orders o-1 ") {
			t.Fatalf("answer %q", got)
		}
		return err
	})
}

// TestStartTimeout: with JetStream unavailable for longer than
// StartTimeout, Start fails with ErrStartTimeout, naming what it waited
// for and why.
func TestStartTimeout(t *testing.T) {
	opts := natstest.ClusterOptions(t, 3)
	url := natstest.URL(natstest.RunServerWithOptions(t, opts[0]))
	s := await(t, startAsync(context.Background(), t, natshard.Options{
		NATS: url, Region: "a", Logger: quiet, StartTimeout: 3 * time.Second,
	}, natshard.Type{Name: "orders", Entity: newEnvEntity, Replicas: 3}))
	if s.err == nil {
		t.Fatal("Start succeeded without a JetStream meta leader")
	}
	for _, want := range []string{`type "orders": open its KV bucket`, "start timeout 3s", "waited", "for its KV bucket natshard_orders", "JetStream stayed unavailable"} {
		if !strings.Contains(s.err.Error(), want) {
			t.Errorf("error %q does not say %q", s.err, want)
		}
	}
	if !errors.Is(s.err, natshard.ErrStartTimeout) || !errors.Is(s.err, kvstate.ErrUnavailable) {
		t.Errorf("error %v: want ErrStartTimeout and kvstate.ErrUnavailable", s.err)
	}
}

// TestStartWaitCancelled: Start's context ends the wait for JetStream.
func TestStartWaitCancelled(t *testing.T) {
	opts := natstest.ClusterOptions(t, 3)
	url := natstest.URL(natstest.RunServerWithOptions(t, opts[0]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := newWaits()
	ch := startAsync(ctx, t, natshard.Options{
		NATS: url, Region: "a", Logger: quiet, StartTimeout: time.Hour, OnStartWait: w.on,
	}, natshard.Type{Name: "orders", Entity: newEnvEntity, Replicas: 3})
	waitedFor(t, w, ch)
	cancel()
	s := await(t, ch)
	if !errors.Is(s.err, context.Canceled) || errors.Is(s.err, natshard.ErrStartTimeout) || !strings.Contains(s.err.Error(), "start cancelled while waiting") {
		t.Fatalf("Start after its context was cancelled: %v", s.err)
	}
}

// TestStartMisconfiguredDoesNotWait: a stored configuration that disagrees
// fails at once, as before, however long the start timeout: it is not
// waited for.
func TestStartMisconfiguredDoesNotWait(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	mustStartOn(t, url, "a", natshard.Type{Name: "orders", Kind: "cart", Entity: newEnvEntity, Shards: 16})
	for _, typ := range []natshard.Type{
		{Name: "orders", Kind: "cart", Shards: 32},
		{Name: "orders", Kind: "echo"},
		{Name: "orders", Kind: "cart", Delivery: natshard.Durable},
	} {
		typ.Entity = newEnvEntity
		w := newWaits()
		s := await(t, startAsync(context.Background(), t, natshard.Options{
			NATS: url, Region: "b", Logger: quiet, StartTimeout: time.Hour, OnStartWait: w.on,
		}, typ))
		if !errors.Is(s.err, natshard.ErrConfigMismatch) || errors.Is(s.err, natshard.ErrStartTimeout) {
			t.Errorf("%+v: %v; want ErrConfigMismatch", typ, s.err)
		}
		if got := w.all(); len(got) != 0 {
			t.Errorf("%+v: Start waited: %v", typ, got)
		}
	}
}

// TestStartWaitsForJetStreamEnabled: a server without JetStream (yet) is
// waited for too (nats.go retries the requests that had no responders
// until the attempt's timeout).
func TestStartWaitsForJetStreamEnabled(t *testing.T) {
	o := natstest.DefaultOptions(t)
	o.JetStream = false
	url := natstest.URL(natstest.RunServerWithOptions(t, o))
	s := await(t, startAsync(context.Background(), t, natshard.Options{
		NATS: url, Region: "a", Logger: quiet, StartTimeout: 3 * time.Second,
	}, natshard.Type{Name: "orders", Entity: newEnvEntity}))
	if !errors.Is(s.err, natshard.ErrStartTimeout) || !strings.Contains(s.err.Error(), "JetStream did not answer in time (its server starting") {
		t.Fatalf("Start on a server without JetStream: %v; want ErrStartTimeout saying JetStream did not answer", s.err)
	}
}

// TestStartDeniedDoesNotWait: a user denied JetStream's API fails once
// its first attempt timed out, saying so, instead of waiting for the
// start timeout.
func TestStartDeniedDoesNotWait(t *testing.T) {
	o := natstest.DefaultOptions(t)
	o.Users = []*server.User{{Username: "app", Password: "pw", Permissions: &server.Permissions{
		Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{"$JS.API.>"}},
	}}}
	srv := natstest.RunServerWithOptions(t, o)
	url := strings.Replace(natstest.URL(srv), "nats://", "nats://app:pw@", 1)
	w := newWaits()
	s := await(t, startAsync(context.Background(), t, natshard.Options{
		NATS: url, Region: "a", Logger: quiet, StartTimeout: time.Hour, OnStartWait: w.on,
	}, natshard.Type{Name: "orders", Entity: newEnvEntity}))
	if s.err == nil || errors.Is(s.err, natshard.ErrStartTimeout) || !strings.Contains(s.err.Error(), "denied JetStream's API") {
		t.Fatalf("Start denied JetStream: %v; want an error saying so", s.err)
	}
	if got := w.all(); len(got) != 0 {
		t.Errorf("Start waited: %v", got)
	}
}
