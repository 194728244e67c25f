package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
)

// gated is an in-memory entity of durable delivery that handles nothing
// while its gate is closed, and records what it handled.
type gated struct {
	gate <-chan struct{}
	seen *sync.Map // payload -> *atomic.Int64, times handled
}

func (g *gated) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	select {
	case <-g.gate:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	n, _ := g.seen.LoadOrStore(string(m.Data), new(atomic.Int64))
	n.(*atomic.Int64).Add(1)
	return nil, nil
}
func (*gated) Stop(context.Context) error { return nil }

// TestStoreFull fills a small JetStream store (8 MiB) three ways while two
// nodes host a durable type (gated entities) and a kv type, with a 2 s
// lease TTL: the durable type's message stream, the kv type's bucket
// with entity state, and the server's whole store with a stream of
// someone else's. In the first two the types keep serving: no region
// fences (their leases renew), kv entities answer, and what is refused
// gets an error naming the cause; nothing acknowledged is lost. In the
// third every write of the server is refused: the regions fence (they
// cannot renew), and once the space is freed both types serve again by
// themselves, with every stored value. Each recovery is polled within a
// bounded wait.
func TestStoreFull(t *testing.T) {
	opts := natstest.DefaultOptions(t)
	opts.JetStreamMaxStore = 8 << 20
	url := natstest.URL(natstest.RunServerWithOptions(t, opts))
	logs := &natstest.Buffer{}
	logger := slog.New(slog.NewTextHandler(logs, nil))
	gate := make(chan struct{})
	seen := &sync.Map{}
	durable := natshard.Type{Name: "d", Shards: 4, Delivery: natshard.Durable,
		BucketBytes: 1 << 20, BufferBytes: 1 << 20, StreamBytes: 2 << 20,
		Entity: func(context.Context, string) (natshard.Entity, error) { return &gated{gate: gate, seen: seen}, nil }}
	kv := natshard.Type{Name: "kv", Kind: "kv", Shards: 4, Entity: entities.KV(nil),
		BucketBytes: 1 << 20, BufferBytes: 512 << 10}
	var nodes []*natshard.Node
	for _, region := range []string{"a", "b"} {
		n, err := natshard.Start(context.Background(), natshard.Options{NATS: url, Region: region, LeaseTTL: 2 * time.Second,
			Logger: logger.With("node", region)}, durable, kv)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(context.Background()) })
		nodes = append(nodes, n)
	}
	nc := natstest.Connect(t, url)
	client := natshard.NewClient(nc, natshard.WithTimeout(3*time.Second))
	ctx := t.Context()
	request := func(id, body string) (string, error) {
		b, err := client.Request(ctx, "kv", id, []byte(body))
		return string(b), err
	}
	for i := range 20 {
		if _, err := request(fmt.Sprintf("k%d", i), fmt.Sprintf(`{"op":"set","key":"v","value":%d}`, i)); err != nil {
			t.Fatal(err)
		}
	}
	fenced := func() (n uint64) {
		for _, node := range nodes {
			for _, typ := range []string{"d", "kv"} {
				st, _ := node.Stats(typ)
				n += st.Fenced
			}
		}
		return n
	}
	// serving checks, while every registration is renewed five times
	// (longer than a lease TTL: 2.5 s at 0.5 s a renewal), that no region
	// fenced and that every kv entity answers a get with its value.
	var registrations []*kvstate.Store
	for _, typ := range []string{"d", "kv"} {
		st, err := kvstate.Bind(ctx, natstest.JetStream(t, nc), typ, kvstate.Options{})
		if err != nil {
			t.Fatal(err)
		}
		registrations = append(registrations, st)
	}
	serving := func(phase string) {
		t.Helper()
		last, renewals := map[string]uint64{}, map[string]int{}
		natstest.Eventually(t, time.Minute, phase+": five renewals of every registration", func() error {
			for i := range 20 {
				got, err := request(fmt.Sprintf("k%d", i), `{"op":"get","key":"v"}`)
				if err != nil || !strings.Contains(got, fmt.Sprintf(`"value":%d`, i)) {
					t.Fatalf("%s: get k%d = %s, %v", phase, i, got, err)
				}
			}
			if f := fenced(); f != 0 {
				t.Fatalf("%s: a region fenced itself (%d times): its lease could not be renewed", phase, f)
			}
			for i, st := range registrations {
				for _, region := range []string{"a", "b"} {
					k := fmt.Sprint(i, region)
					if _, rev, err := st.Region(ctx, region); err == nil && rev != last[k] {
						if last[k] != 0 {
							renewals[k]++
						}
						last[k] = rev
					}
				}
			}
			if len(renewals) < 4 || slices.Min(slices.Collect(maps.Values(renewals))) < 5 {
				return fmt.Errorf("renewals of the registrations seen: %v", renewals)
			}
			return nil
		})
	}
	// within is how long cond took to hold (for the log: no bound is
	// asserted but the wait's).
	within := func(t *testing.T, what string, d time.Duration, cond func() error) time.Duration {
		t.Helper()
		start := time.Now()
		natstest.Eventually(t, d, what, cond)
		return time.Since(start)
	}

	t.Run("MessageStream", func(t *testing.T) {
		// Fill the durable type's stream: its entities handle nothing.
		payload := strings.Repeat("m", 4<<10)
		var acked []string
		var refused error
		for i := 0; refused == nil; i++ {
			if i > 2000 {
				t.Fatal("2000 messages of 4 KiB stored in a stream of 2 MiB")
			}
			body := fmt.Sprintf("%d %s", i, payload)
			if err := client.Publish(ctx, "d", fmt.Sprintf("e%d", i%10), []byte(body)); err != nil {
				refused = err
				break
			}
			acked = append(acked, body)
		}
		if !errors.Is(refused, kvstate.ErrNoSpace) || !strings.Contains(refused.Error(), "maximum bytes exceeded") {
			t.Fatalf("publish to the full stream refused with %v; want ErrNoSpace, maximum bytes exceeded", refused)
		}
		t.Logf("%d messages acknowledged, then: %v", len(acked), refused)
		serving("durable stream full")
		close(gate)
		took := within(t, "every acknowledged message handled", 30*time.Second, func() error {
			for _, body := range acked {
				n, ok := seen.Load(body)
				if !ok {
					return fmt.Errorf("message %.8q... not handled", body)
				}
				if c := n.(*atomic.Int64).Load(); c != 1 {
					t.Fatalf("message %.8q... handled %d times", body, c)
				}
			}
			return nil
		})
		took2 := within(t, "a publish accepted again", 30*time.Second, func() error {
			return client.Publish(ctx, "d", "e0", []byte("after"))
		})
		t.Logf("all %d handled %v after the gate opened; a publish accepted %v later", len(acked), took.Round(time.Millisecond), took2.Round(time.Millisecond))
	})

	t.Run("Bucket", func(t *testing.T) {
		// Fill the kv type's bucket with entity state.
		value := strings.Repeat("s", 8<<10)
		var stored []string
		var refused string
		for i := 0; refused == ""; i++ {
			if i > 300 {
				t.Fatal("300 documents of 8 KiB stored in a bucket of 1 MiB")
			}
			id := fmt.Sprintf("big%d", i)
			got, err := request(id, fmt.Sprintf(`{"op":"set","key":"v","value":%q}`, value))
			var ee *natshard.EntityError
			switch {
			case errors.As(err, &ee):
				refused = err.Error() + " " + got
			case err != nil:
				t.Fatalf("set %s: %v", id, err)
			default:
				stored = append(stored, id)
			}
		}
		if !strings.Contains(refused, "no space") || !strings.Contains(refused, "KV_natshard_kv") {
			t.Fatalf("set into the full bucket answered %s; want an error naming the cause", refused)
		}
		t.Logf("%d documents of 8 KiB stored, then: %s", len(stored), refused)
		serving("bucket full of entity state")
		// Writes that add no bytes pass, and free the space for others.
		for _, id := range stored[:len(stored)/2] {
			if got, err := request(id, `{"op":"delete","key":"v"}`); err != nil {
				t.Fatalf("delete in %s with the bucket full: %s, %v", id, got, err)
			}
		}
		took := within(t, "a set accepted again", 30*time.Second, func() error {
			_, err := request("after", fmt.Sprintf(`{"op":"set","key":"v","value":%q}`, value))
			return err
		})
		t.Logf("a set accepted %v after half the documents were emptied", took.Round(time.Millisecond))
	})

	t.Run("Server", func(t *testing.T) {
		// Fill the whole store with a stream that has no limit.
		js := natstest.JetStream(t, nc)
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "filler", Subjects: []string{"filler"}}); err != nil {
			t.Fatal(err)
		}
		for i := 0; ; i++ {
			if i > 1000 {
				t.Fatal("64 MiB stored in a store of 8 MiB")
			}
			if _, err := js.Publish(ctx, "filler", make([]byte, 64<<10)); err != nil {
				t.Logf("filler refused after %d KiB: %v", i*64, err)
				break
			}
		}
		start := time.Now()
		_, err := request("k0", `{"op":"incr","key":"v"}`)
		if err == nil || !strings.Contains(err.Error(), "insufficient resources") {
			t.Fatalf("a write with the server's store full: %v; want an error naming insufficient resources", err)
		}
		within(t, "the regions fenced (their leases cannot be renewed)", 20*time.Second, func() error {
			if fenced() == 0 {
				return errors.New("none fenced")
			}
			return nil
		})
		t.Logf("fenced %v after the store filled", time.Since(start).Round(time.Millisecond))
		if err := js.DeleteStream(ctx, "filler"); err != nil {
			t.Fatal(err)
		}
		freed := time.Now()
		within(t, "every kv entity answers again", 60*time.Second, func() error {
			for i := range 20 {
				want := i
				if i == 0 {
					want = 0 // the incr above was refused
				}
				got, err := request(fmt.Sprintf("k%d", i), `{"op":"get","key":"v"}`)
				if err != nil {
					return err
				}
				if !strings.Contains(got, fmt.Sprintf(`"value":%d`, want)) {
					t.Fatalf("k%d = %s after the recovery, want %d", i, got, want)
				}
			}
			return client.Publish(ctx, "d", "e1", []byte("after the store was freed"))
		})
		within(t, "both nodes ready", 30*time.Second, func() error {
			return errors.Join(nodes[0].Ready(), nodes[1].Ready())
		})
		t.Logf("served and ready again %v after the space was freed", time.Since(freed).Round(time.Millisecond))
	})
	if t.Failed() {
		t.Logf("logs:\n%s", logs)
	}
	// The regions log refusals once per 10 s per stream, naming it and
	// its limit (the publishers of the message stream get their own
	// error; no region writes to it).
	for _, want := range []string{"JetStream refused writes for lack of space", "stream=KV_natshard_kv max_bytes=1048576"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the logs do not say %q", want)
		}
	}
}
