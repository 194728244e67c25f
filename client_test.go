package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// newType creates type typ with shards in the server at url, as a node's
// first start would, and returns its subjects.
func newType(t testing.TB, url, typ string, shards int) protocol.Subjects {
	t.Helper()
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, natstest.Connect(t, url)), typ, kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.EnsureConfig(context.Background(), protocol.TypeConfig{Shards: shards}); err != nil {
		t.Fatal(err)
	}
	return protocol.MustSubjects("", "", typ)
}

// TestClientWaitsForAnOwner: a request to a shard that nobody serves yet
// ("no responders": after a crash, before parking) is delayed until a
// node serves it, not failed.
func TestClientWaitsForAnOwner(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	newType(t, url, "t", 4)
	nc := natstest.Connect(t, url)
	c := natshard.NewClient(nc)
	// With a deadline and nobody, the error says what happened (and the
	// client knows the type after it).
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := c.Request(ctx, "t", "early", nil); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no responders") {
		t.Fatalf("request to a type nobody serves: %v", err)
	}
	type result struct {
		data []byte
		err  error
	}
	done := make(chan result, 1)
	sent := nc.Stats().OutMsgs
	go func() {
		data, err := c.Request(context.Background(), "t", "late", []byte("x"))
		done <- result{data, err}
	}()
	natstest.Eventually(t, 30*time.Second, "the request sent twice: it met no responders and was sent again", func() bool {
		return nc.Stats().OutMsgs >= sent+2
	})
	select {
	case r := <-done:
		t.Fatalf("answered before any node ran: %q, %v", r.data, r.err)
	default:
	}
	mustStartOn(t, url, "a", natshard.Type{Name: "t", Entity: newEnvEntity})
	select {
	case r := <-done:
		if r.err != nil || !strings.HasPrefix(string(r.data), "t late") {
			t.Fatalf("%q, %v", r.data, r.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no answer once a node served the type")
	}
	// The same for a type the client looks up.
	newType(t, url, "nobody", 4)
	ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := c.Request(ctx, "nobody", "x", nil); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no responders") {
		t.Fatalf("request to a type nobody serves: %v", err)
	}
}

// TestClientRetriesRefusals: a message that a region refused without
// handling it (Natshard-Refused) is sent again; a malformed one is not; an
// entity's error is returned as an *EntityError, not retried.
func TestClientRetriesRefusals(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	subjects := newType(t, url, "t", 4)
	region := natstest.Connect(t, url) // plays the regions
	var calls atomic.Int32
	var mu sync.Mutex
	var ids []string
	if _, err := region.Subscribe(subjects.AllData(), func(m *nats.Msg) {
		n := calls.Add(1)
		mu.Lock()
		ids = append(ids, protocol.MessageKey(m.Header, m.Reply))
		if m.Header != nil {
			ids = append(ids, fmt.Sprintf("a header: %v", m.Header))
		}
		mu.Unlock()
		switch id := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]; {
		case id == "moving" && n == 1:
			_ = region.PublishMsg(protocol.RefusedReply(m.Reply, protocol.RefusedNotOwned, nil, errors.New("shard 1 is not served by region a")))
		case id == "bad":
			_ = region.PublishMsg(protocol.RefusedReply(m.Reply, protocol.RefusedMalformed, nil, errors.New("wrong shard")))
		case id == "failing":
			_ = region.PublishMsg(protocol.ErrorReply(m.Reply, []byte(`{"ok":false}`), errors.New("no stock")))
		default:
			_ = m.Respond([]byte("ok " + id))
		}
	}); err != nil {
		t.Fatal(err)
	}
	c := natshard.NewClient(natstest.Connect(t, url))
	ctx := context.Background()
	if got, err := c.Request(ctx, "t", "moving", nil); err != nil || string(got) != "ok moving" || calls.Load() != 2 {
		t.Fatalf("refused then answered: %q, %v after %d calls", got, err, calls.Load())
	}
	// Every request has a key (so that copies are skipped during moves),
	// the same when it is sent again: its reply subject, marked unique;
	// it carries no header.
	mu.Lock()
	if len(ids) != 2 || ids[0] == "" || ids[0] != ids[1] {
		t.Fatalf("sent with ids %q, want twice the same", ids)
	}
	mu.Unlock()
	calls.Store(0)
	if _, err := c.Request(ctx, "t", "bad", nil); err == nil || !strings.Contains(err.Error(), "wrong shard") || calls.Load() != 1 {
		t.Fatalf("malformed: %v after %d calls", err, calls.Load())
	}
	calls.Store(0)
	got, err := c.Request(ctx, "t", "failing", nil)
	var ee *natshard.EntityError
	if !errors.As(err, &ee) || ee.Message != "no stock" || string(ee.Data) != `{"ok":false}` || string(got) != `{"ok":false}` || calls.Load() != 1 {
		t.Fatalf("entity error: %q, %v after %d calls", got, err, calls.Load())
	}
	// A publish has no reply subject: it carries a Nats-Msg-Id.
	mu.Lock()
	ids = nil
	mu.Unlock()
	if err := c.Publish(ctx, "t", "published", nil); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 20*time.Second, "the publish to arrive", func() bool { mu.Lock(); defer mu.Unlock(); return len(ids) > 0 })
	mu.Lock()
	defer mu.Unlock()
	if len(ids) != 2 || !strings.HasPrefix(ids[1], "a header: map[Nats-Msg-Id:") || ids[0] == "" {
		t.Fatalf("a publish sent as %q, want a key in a Nats-Msg-Id", ids)
	}
}

// TestClientsShareASubscription: the clients of a connection wait for
// their answers on one subscription, however many are made (a client per
// call is fine); once the connection is closed, a request says so.
func TestClientsShareASubscription(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	subjects := newType(t, url, "t", 4)
	region := natstest.Connect(t, url)
	if _, err := region.Subscribe(subjects.AllData(), func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		t.Fatal(err)
	}
	if err := region.Flush(); err != nil {
		t.Fatal(err)
	}
	nc := natstest.Connect(t, url)
	ctx := context.Background()
	first := natshard.NewClient(nc)
	request := func(c *natshard.Client) error {
		if c == nil {
			c = natshard.NewClient(nc)
		}
		got, err := c.Request(ctx, "t", "x", []byte("hi"))
		if err == nil && string(got) != "hi" {
			err = fmt.Errorf("answer %q", got)
		}
		return err
	}
	if err := request(first); err != nil {
		t.Fatal(err)
	}
	subs := nc.NumSubscriptions()
	for range 5 {
		if err := request(nil); err != nil {
			t.Fatal(err)
		}
	}
	if n := nc.NumSubscriptions(); n != subs {
		t.Fatalf("%d subscriptions after five more clients' requests, %d after the first", n, subs)
	}
	nc.Close()
	// A client that knows the type, and one that would learn it.
	for _, c := range []*natshard.Client{first, nil} {
		if err := request(c); !errors.Is(err, nats.ErrConnectionClosed) {
			t.Fatalf("request on a closed connection: %v", err)
		}
	}
}

// TestClientResend: with WithResend, a request that got no answer (its
// region died with it) is sent again with the same key (its reply
// subject); without, it waits for its deadline. MsgID's key goes first.
func TestClientResend(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	subjects := newType(t, url, "t", 4)
	region := natstest.Connect(t, url)
	var mu sync.Mutex
	var ids []string
	if _, err := region.Subscribe(subjects.AllData(), func(m *nats.Msg) {
		mu.Lock()
		ids = append(ids, protocol.MessageKey(m.Header, m.Reply))
		first := len(ids) == 1
		mu.Unlock()
		if !first { // the first is lost with its region
			_ = m.Respond([]byte("done"))
		}
	}); err != nil {
		t.Fatal(err)
	}
	nc := natstest.Connect(t, url)
	got, err := natshard.NewClient(nc, natshard.WithResend(100*time.Millisecond)).Request(context.Background(), "t", "x", nil)
	mu.Lock()
	if err != nil || string(got) != "done" || len(ids) != 2 || ids[0] == "" || ids[0] != ids[1] {
		t.Fatalf("%q, %v; sent with ids %q, want twice the same", got, err, ids)
	}
	ids = nil
	mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	// ids is empty again: this request is the one lost.
	_, err = natshard.NewClient(nc).Request(ctx, "t", "y", nil, natshard.MsgID("k1"))
	mu.Lock()
	if !errors.Is(err, context.DeadlineExceeded) || len(ids) != 1 || ids[0] != "k1" {
		t.Fatalf("without resend: %v, sent %q", err, ids)
	}
	ids = nil
	mu.Unlock()
	// A context without a deadline: the client's timeout ends the call,
	// and a resend due after it is not sent.
	c := natshard.NewClient(nc, natshard.WithTimeout(200*time.Millisecond), natshard.WithResend(time.Hour))
	_, err = c.Request(context.Background(), "t", "z", nil)
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(err, context.DeadlineExceeded) || len(ids) != 1 {
		t.Fatalf("past the client's timeout: %v, sent %q", err, ids)
	}
}
