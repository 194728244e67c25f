package host

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// TestHostCounts: the host counts activations, messages handled and
// failed (an error, a panic, a factory that fails), passivations and
// refusals of a stopping shard; the counts of a shard survive its stop,
// and no count ever goes down.
func TestHostCounts(t *testing.T) {
	block := make(chan struct{})
	f := &testFactory{
		handle: func(_ int, m *Message) ([]byte, error) {
			switch string(m.Data) {
			case "slow":
				<-block
			case "fail":
				return nil, errors.New("asked to fail")
			case "panic":
				panic("asked to panic")
			}
			return m.Data, nil
		},
		fail: func(call int) error {
			if call == 1 {
				return errors.New("first activation fails")
			}
			return nil
		},
	}
	clock := hosttest.NewClock()
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) { c.IdleTimeout = time.Minute; c.Now = clock.Now })
	// Shard 0: a's first activation fails, then 3 messages, one failing;
	// b panics (its incarnation is dropped), then handles one more.
	for _, m := range []*nats.Msg{req("a", "x"), req("a", "ok"), req("a", "fail"), req("a", "ok"), req("b", "panic"), req("b", "ok")} {
		h.Deliver(0, m.Subject[len("shard.t.0."):], m)
		rec.next(t)
	}
	natstest.Eventually(t, 5*time.Second, "quiet", func() bool { return quiet(h) })
	want := msgCounts{delivered: 6, handled: 6, failed: 3}
	if got := h.msgCounts(); got != want {
		t.Fatalf("counts %+v, want %+v", got, want)
	}
	if got := h.activations.Load(); got != 3 { // a (second try), b, b after the panic
		t.Fatalf("activations %d, want 3", got)
	}
	// Passivation of both.
	clock.Advance(2 * time.Minute)
	if n := h.PassivateIdle(); n != 2 {
		t.Fatalf("passivateIdle started %d stops, want 2", n)
	}
	natstest.Eventually(t, 5*time.Second, "passivations", func() bool { return h.passivations.Load() == 2 })
	// Shard 1: one message, then the shard stops: its counts move to the
	// host's, and a delivery to it meanwhile is refused and counted.
	h.Deliver(1, "c", req("c", "ok"))
	rec.next(t)
	h.Deliver(1, "c", req("c", "slow"))
	done := make(chan error, 1)
	go func() { done <- h.StopShard(context.Background(), 1) }()
	natstest.Eventually(t, 5*time.Second, "the shard closing", func() bool {
		se := h.lookup(1)
		se.mu.Lock()
		defer se.mu.Unlock()
		return se.closing
	})
	h.Deliver(1, "c", req("c", "refused"))
	if r := rec.next(t); !errors.Is(r.err, errShardNotServed) {
		t.Fatalf("delivery to a stopping shard answered %+v", r)
	}
	close(block)
	rec.next(t)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	want = msgCounts{delivered: 8, handled: 8, failed: 3} // the refused message is not delivered
	if got := h.msgCounts(); got != want {
		t.Fatalf("after the shard's stop: counts %+v, want %+v", got, want)
	}
	if got := h.refusedStopping.Load(); got != 1 {
		t.Fatalf("refused while stopping %d, want 1", got)
	}
	if got := h.passivations.Load(); got != 2 {
		t.Fatalf("a shard's stop counted as passivation: %d", got)
	}
}

// TestHostCountsNeverGoDown reads the counts while shards are stopped and
// started again under load (until 20 shards were stopped, and 100 reads
// at least): each read is at least the one before.
func TestHostCountsNeverGoDown(t *testing.T) {
	f := &testFactory{}
	rec := &recorder{ch: make(chan captured, 1<<16)}
	h := newTestHost(t, f.factory, rec, nil)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var stopped atomic.Int64
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			h.Deliver(i%4, "e", pub("e", "x"))
			if i%500 == 0 {
				_ = h.StopShard(context.Background(), i%4)
				stopped.Add(1)
			}
		}
	})
	var last msgCounts
	for reads := 0; stopped.Load() < 20 || reads < 100; reads++ {
		c := h.msgCounts()
		if c.handled < last.handled || c.delivered < last.delivered {
			close(stop)
			wg.Wait()
			t.Fatalf("counts went down from %+v to %+v", last, c)
		}
		last = c
	}
	close(stop)
	wg.Wait()
	if last.handled == 0 {
		t.Fatal("nothing was handled")
	}
}

// TestHostTrace: the trace hook runs only for messages with headers; its
// context reaches the factory and Handle, and its end function gets the
// outcome.
func TestHostTrace(t *testing.T) {
	type key struct{}
	var (
		mu    sync.Mutex
		seen  []string // what the entity saw in its contexts
		ended = make(chan error, 3)
	)
	factory := func(ctx context.Context, id string) (Entity, error) {
		mu.Lock()
		seen = append(seen, "factory:"+str(ctx.Value(key{})))
		mu.Unlock()
		return &ctxEntity{fn: func(ctx context.Context, m *Message) ([]byte, error) {
			mu.Lock()
			seen = append(seen, string(m.Data)+":"+str(ctx.Value(key{})))
			mu.Unlock()
			if string(m.Data) == "fail" {
				return nil, errors.New("failed")
			}
			return nil, nil
		}}, nil
	}
	rec := newRecorder()
	h := newTestHost(t, factory, rec, func(c *Config) {
		c.Trace = func(ctx context.Context, m *nats.Msg) (context.Context, func(error)) {
			return context.WithValue(ctx, key{}, m.Header.Get("traceparent")), func(err error) { ended <- err }
		}
	})
	traced := func(data, tp string) *nats.Msg {
		m := req("a", data)
		m.Header = nats.Header{"traceparent": []string{tp}}
		return m
	}
	h.Deliver(0, "a", traced("one", "tp1"))
	rec.next(t)
	h.Deliver(0, "a", req("a", "plain"))
	rec.next(t)
	h.Deliver(0, "a", traced("fail", "tp2"))
	rec.next(t)
	mu.Lock()
	if want := []string{"factory:tp1", "one:tp1", "plain:", "fail:tp2"}; !equal(seen, want) {
		t.Fatalf("contexts seen %q, want %q", seen, want)
	}
	mu.Unlock()
	// An end function runs once its message's delivery returned, which
	// may be after the answer was sent: they are waited for, in order.
	var got []error
	for range 2 {
		select {
		case err := <-ended:
			got = append(got, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("end functions got %v, then nothing for 10 s; want [nil failed]", got)
		}
	}
	if got[0] != nil || got[1] == nil || got[1].Error() != "failed" {
		t.Fatalf("end functions got %v, want [nil failed]", got)
	}
	select {
	case err := <-ended:
		t.Fatalf("a third end function (%v) for two traced messages", err)
	default:
	}
}

type ctxEntity struct {
	fn func(ctx context.Context, m *Message) ([]byte, error)
}

func (e *ctxEntity) Handle(ctx context.Context, m *Message) ([]byte, error) { return e.fn(ctx, m) }
func (e *ctxEntity) Stop(context.Context) error                             { return nil }

func str(v any) string {
	s, _ := v.(string)
	return s
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
