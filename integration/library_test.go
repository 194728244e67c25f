package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
	"github.com/natshard/natshard/examples/ratelimit"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestLibraryExample runs three processes of the library's example program
// (examples/shop: carts, persistent, and rate limiters, in memory; two
// types in one process), the first with the embedded NATS server, and
// sends requests with natshard's Client while one process is killed with
// -9 and another stops gracefully (issue 12). It proves: every request is
// answered (none fails for want of an owner: the client waits and, for
// the few that died with the killed process, sends again); every cart
// holds exactly what was acknowledged; every shard has one owner
// throughout (a sampler asks each shard once with a Nats-Msg-Id, again and
// again: an answer from two regions fails the test).
func TestLibraryExample(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	procs := map[string]*proc{
		"a": startProcess(t, "shop", "a", "-listen", fmt.Sprintf("127.0.0.1:%d", port), "-data-dir", t.TempDir(), "-region", "a"),
	}
	nc := connect(t, url)
	types := map[string]protocol.Subjects{
		"cart":      protocol.MustSubjects("", "", "cart"),
		"ratelimit": protocol.MustSubjects("", "", "ratelimit"),
	}
	settledAll := func(live ...string) {
		t.Helper()
		for _, s := range types {
			waitSettled(t, nc, s, 90*time.Second, live...)
		}
	}
	settledAll("a")
	procs["b"] = startProcess(t, "shop", "b", "-nats", url, "-region", "b")
	procs["c"] = startProcess(t, "shop", "c", "-nats", url, "-region", "c")
	// Rebalanced onto all three: every region holds shards of both types.
	natstest.Eventually(t, 90*time.Second, "both types spread over a, b and c", func() error {
		for typ, s := range types {
			st, err := status(nc, s)
			if err != nil {
				return err
			}
			if err := settled(st, "a", "b", "c"); err != nil {
				return err
			}
			for _, r := range st.Regions {
				if r.Shards == 0 {
					return fmt.Errorf("%s: region %s holds no shard yet", typ, r.ID)
				}
			}
		}
		return nil
	})
	for typ, s := range types {
		st, _ := status(nc, s)
		assertSingleOwner(t, nc, s, st.Shards)
		t.Logf("%s: %d shards on a, b and c", typ, st.Shards)
	}

	// The load: carts are set item by item (idempotent, so a request
	// sent again is harmless); limiters are asked.
	client := natshard.NewClient(nc, natshard.WithResend(2*time.Second))
	const carts, workers = 60, 12
	var (
		answered, limited atomic.Int64
		mu                sync.Mutex
		acked             = map[string][]int{} // cart -> items acknowledged
		failures          []string
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		if len(failures) < 10 {
			failures = append(failures, fmt.Sprintf(format, args...))
		}
		mu.Unlock()
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for seq := 0; ; seq++ {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				id := fmt.Sprintf("cart-%d", (w+seq*workers)%carts)
				req, _ := json.Marshal(cart.Request{Op: "set", Item: fmt.Sprintf("i%d-%d", w, seq), Count: 1})
				if _, err := client.Request(ctx, "cart", id, req); err != nil {
					fail("%s set %s: %v", id, req, err)
				} else {
					answered.Add(1)
					mu.Lock()
					acked[id] = append(acked[id], w<<20|seq)
					mu.Unlock()
				}
				var lim ratelimit.Answer
				if data, err := client.Request(ctx, "ratelimit", fmt.Sprintf("user-%d", seq%40), nil); err != nil || json.Unmarshal(data, &lim) != nil {
					fail("ratelimit: %q %v", data, err)
				} else if lim.Allowed {
					limited.Add(1)
				}
				cancel()
			}
		})
	}
	owners := sampleOwners(t, nc, types)
	pause := func() { time.Sleep(2 * time.Second) }

	pause()
	t0 := time.Now()
	procs["b"].kill()
	settledAll("a", "c")
	t.Logf("kill -9 of b: both types settled on a and c after %s", time.Since(t0).Round(time.Millisecond))
	pause()
	t0 = time.Now()
	if err := procs["c"].stop(time.Minute); err != nil {
		t.Fatalf("graceful stop of c: %v", err)
	}
	settledAll("a")
	t.Logf("graceful stop of c: exited and settled on a after %s", time.Since(t0).Round(time.Millisecond))
	pause()
	close(stop)
	wg.Wait()
	owners.stop()

	mu.Lock()
	defer mu.Unlock()
	if len(failures) > 0 {
		t.Fatalf("requests failed:\n%v", failures)
	}
	if answered.Load() == 0 {
		t.Fatal("no request answered")
	}
	// Every cart holds exactly what was acknowledged: nothing lost, and
	// nothing that was not asked.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	checked := 0
	for id, seqs := range acked {
		data, err := client.Request(ctx, "cart", id, []byte(`{"op":"get"}`))
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		var got cart.Cart
		if err := json.Unmarshal(data, &got); err != nil {
			t.Fatalf("%s: %q: %v", id, data, err)
		}
		for _, s := range seqs {
			item := fmt.Sprintf("i%d-%d", s>>20, s&(1<<20-1))
			if got.Items[item] != 1 {
				t.Fatalf("%s: acknowledged item %s is %d in the cart", id, item, got.Items[item])
			}
		}
		if len(got.Items) != len(seqs) {
			t.Fatalf("%s holds %d items, %d were acknowledged", id, len(got.Items), len(seqs))
		}
		checked++
	}
	// The typed API across processes: this process sends, the shop's
	// processes host. A typed Ask, a declared error matched by its code,
	// and the same entity asked with a raw request in JSON.
	typed := cart.Key.Ref(client, "typed-1")
	got, err := typed.Ask(ctx, cart.Request{Op: "add", Item: "apple", Count: 2}, natshard.MsgID("typed-add-1"))
	if err != nil || got.Items["apple"] != 2 {
		t.Fatalf("typed add: %v, %v", got.Items, err)
	}
	if again, err := typed.Ask(ctx, cart.Request{Op: "add", Item: "apple", Count: 2}, natshard.MsgID("typed-add-1")); err != nil || again.Items["apple"] != 2 {
		t.Fatalf("typed add sent again with its key: %v, %v; want it applied once", again.Items, err)
	}
	if _, err := typed.Ask(ctx, cart.Request{Op: "buy"}); !errors.Is(err, natshard.ErrBadRequest) {
		t.Fatalf("typed buy: %v; want bad-request", err)
	}
	st, err := status(nc, types["cart"])
	if err != nil {
		t.Fatal(err)
	}
	subject := types["cart"].EntityOf("typed-1", st.Shards)
	rawAsk := func(body string) *nats.Msg {
		t.Helper()
		for {
			raw, err := nc.Request(subject, []byte(body), 10*time.Second)
			switch {
			case err == nil && raw.Header.Get(protocol.HeaderRefused) == "":
				return raw
			case ctx.Err() != nil:
				t.Fatalf("raw request %s: %v", body, err)
			}
			time.Sleep(100 * time.Millisecond) // no owner this moment, or refused: again
		}
	}
	if raw := rawAsk(`{"op":"get"}`); string(raw.Data) != `{"items":{"apple":2}}` {
		t.Fatalf("raw JSON get: %s", raw.Data)
	}
	if raw := rawAsk(`{"op":`); raw.Header.Get(protocol.HeaderErrorCode) != "bad-request" {
		t.Fatalf("raw JSON that does not decode: %s %s; want the code bad-request", raw.Header.Get(protocol.HeaderError), raw.Data)
	}
	t.Logf("library example: %d cart requests answered (%d carts checked), %d rate limiter requests allowed; 0 failed; single owner in %d samples",
		answered.Load(), checked, limited.Load(), owners.samples.Load())
}

// ownerSampler asks every shard of the types once, again and again, each
// time with a new Nats-Msg-Id, and fails the test when a shard answers
// twice: two regions serving it at once.
type ownerSampler struct {
	done    chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
	samples atomic.Int64
}

func sampleOwners(t *testing.T, nc *nats.Conn, types map[string]protocol.Subjects) *ownerSampler {
	s := &ownerSampler{done: make(chan struct{})}
	t.Cleanup(s.stop) // before the test ends, whatever happens
	s.wg.Go(func() {
		for {
			select {
			case <-s.done:
				return
			case <-time.After(300 * time.Millisecond):
			}
			for typ, subjects := range types {
				st, err := status(nc, subjects)
				if err != nil {
					continue // no coordinator this moment
				}
				if err := singleOwner(nc, subjects, st.Shards); err != nil && !errors.Is(err, errNoOwner) {
					t.Errorf("%s: %v", typ, err)
				}
				s.samples.Add(1)
			}
		}
	})
	return s
}

func (s *ownerSampler) stop() {
	s.once.Do(func() { close(s.done) })
	s.wg.Wait()
}
