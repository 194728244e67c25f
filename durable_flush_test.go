package natshard_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
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

// answerStateStore is what a type's Env.Store is (*kvstate.Store).
type answerStateStore interface {
	natshard.StateStore
	natshard.AnswerStore
}

// writeGate sees the state writes of the kv entities that a node's
// factory (gatedKV) made: the applied sequence of each, and at is called
// for the n-th (1-based) instead of the write, with the write to make.
type writeGate struct {
	mu   sync.Mutex
	seqs []uint64
	at   func(n int, write func() (uint64, error)) (uint64, error)
}

func (g *writeGate) written() []uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.seqs)
}

type gatedStore struct {
	answerStateStore
	g *writeGate
}

func (s gatedStore) SaveEntityState(ctx context.Context, id string, st natshard.EntityState) (uint64, error) {
	write := func() (uint64, error) { return s.answerStateStore.SaveEntityState(ctx, id, st) }
	s.g.mu.Lock()
	s.g.seqs = append(s.g.seqs, st.Seq)
	n, at := len(s.g.seqs), s.g.at
	s.g.mu.Unlock()
	if at == nil {
		return write()
	}
	return at(n, write)
}

// writeGatedKV is the kv kind on its type's store, every write seen by g.
func writeGatedKV(g *writeGate) natshard.Factory {
	return func(ctx context.Context, id string) (natshard.Entity, error) {
		env := natshard.EnvFrom(ctx)
		inner, ok := env.Store.(answerStateStore)
		if !ok {
			return nil, fmt.Errorf("the type's store is a %T", env.Store)
		}
		return entities.KV(gatedStore{answerStateStore: inner, g: g})(ctx, id)
	}
}

// publishIncrs publishes n increments to entity id through the stream
// and returns their stream sequences.
func publishIncrs(t *testing.T, js jetstream.JetStream, id string, shards, n int) []uint64 {
	t.Helper()
	subject := protocol.MustSubjects("", "", "kv").EntityOf(id, shards)
	var seqs []uint64
	for range n {
		ack, err := js.Publish(context.Background(), subject, []byte(`{"op":"incr","key":"n"}`))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	return seqs
}

// wantCount waits until entity id's n is want, read through the Client.
func wantCount(t *testing.T, c *natshard.Client, id string, want int) {
	t.Helper()
	natstest.Eventually(t, time.Minute, fmt.Sprintf("entity %s to count %d", id, want), func() error {
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
		if got.Value != json.Number(fmt.Sprint(want)) {
			return fmt.Errorf("n = %s, want %d", got.Value, want)
		}
		return nil
	})
}

// TestDurableKVRunInOneWrite (PROTOCOL.md, "Group commit"): the messages
// queued for a kv entity while it stored one are applied and stored by
// one write, with the sequence of the last; each is applied once, and
// every one leaves the stream (acknowledged).
//
// refused: the run's write fails (not stored); none of its messages is
// acknowledged, and they are stored again one at a time, each applied
// once.
func TestDurableKVRunInOneWrite(t *testing.T) {
	t.Run("stored", func(t *testing.T) { testDurableKVRun(t, false) })
	t.Run("refused", func(t *testing.T) { testDurableKVRun(t, true) })
}

func testDurableKVRun(t *testing.T, refuse bool) {
	url := natstest.URL(natstest.RunServer(t))
	entered, release := make(chan struct{}), make(chan struct{})
	g := &writeGate{at: func(n int, write func() (uint64, error)) (uint64, error) {
		switch {
		case n == 1:
			close(entered)
			<-release
		case n == 2 && refuse:
			return 0, fmt.Errorf("refused: %w", kvstate.ErrConflict)
		}
		return write()
	}}
	typ := natshard.Type{Name: "kv", Kind: "kv", Shards: 8, Entity: writeGatedKV(g)}
	node := durableNode(t, url, "a", typ)
	natstest.Eventually(t, 30*time.Second, "a to hold the 8 shards", func() bool { st, _ := node.Stats("kv"); return len(st.Shards) == 8 })
	js := natstest.JetStream(t, natstest.Connect(t, url))

	const n = 50
	seqs := publishIncrs(t, js, "e0", 8, 1)
	<-entered // the first message's write waits: the others queue
	seqs = append(seqs, publishIncrs(t, js, "e0", 8, n-1)...)
	natstest.Eventually(t, 30*time.Second, "every message handed to the entity", func() bool {
		st, _ := node.Stats("kv")
		return st.Delivered >= n
	})
	close(release)
	wantCount(t, natshard.NewClient(natstest.Connect(t, url)), "e0", n)
	want := []uint64{seqs[0], seqs[n-1]} // the first message, then the others queued, in one write
	if refuse {
		want = append(want, seqs[1:]...) // then one at a time
	}
	if got := g.written(); !slices.Equal(got, want) {
		t.Fatalf("writes with applied sequences %v, want %v", got, want)
	}
	natstest.Eventually(t, 30*time.Second, "the stream empty: every message acknowledged", func() error {
		for name := range js.StreamNames(context.Background()).Name() {
			if !strings.HasPrefix(name, "natshard_msgs_") {
				continue // the type's buckets
			}
			s, err := js.Stream(context.Background(), name)
			if err != nil {
				return err
			}
			// The last message a shard handled is acknowledged with the
			// next (region.streamShard.handled): here the last request
			// of wantCount.
			if st := s.CachedInfo().State; st.Msgs > 1 || st.Msgs == 1 && st.FirstSeq <= seqs[n-1] {
				return fmt.Errorf("stream %s holds %d messages from %d", name, st.Msgs, st.FirstSeq)
			}
		}
		return nil
	})
}

// TestDurableKVRunCrash (PROTOCOL.md, "Group commit"): the region
// holding a kv entity dies (its connection closes) with a run of the
// entity's messages applied in memory and not stored, or stored and not
// acknowledged; the next owner applies every message once.
func TestDurableKVRunCrash(t *testing.T) {
	for _, stored := range []bool{false, true} {
		name := map[bool]string{false: "before-write", true: "after-write"}[stored]
		t.Run(name, func(t *testing.T) { testDurableKVRunCrash(t, stored) })
	}
}

func testDurableKVRunCrash(t *testing.T, stored bool) {
	url := natstest.URL(natstest.RunServer(t))
	durableNode(t, url, "a", natshard.Type{Name: "kv", Kind: "kv", Shards: 8, Entity: entities.KV(nil)})
	ncB, err := nats.Connect(url, natshard.ConnectOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	entered, release, died := make(chan struct{}), make(chan struct{}), make(chan struct{})
	g := &writeGate{at: func(n int, write func() (uint64, error)) (uint64, error) {
		switch n {
		case 1:
			close(entered)
			<-release
		case 2: // the run: b dies before or after its write
			rev, err := uint64(0), error(fmt.Errorf("b died: %w", kvstate.ErrUnavailable))
			if stored {
				rev, err = write()
			}
			ncB.Close()
			close(died)
			return rev, err
		default:
			return 0, fmt.Errorf("b is dead: %w", kvstate.ErrUnavailable)
		}
		return write()
	}}
	b, err := natshard.Start(context.Background(), natshard.Options{Conn: ncB, Region: "b", NoCoordinator: true, Logger: quiet},
		natshard.Type{Name: "kv", Kind: "kv", Shards: 8, Delivery: natshard.Durable, Entity: writeGatedKV(g)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	var id string
	natstest.Eventually(t, 30*time.Second, "a shard on b", func() bool {
		st, _ := b.Stats("kv")
		for _, s := range st.Shards {
			for i := range 1000 {
				if cand := fmt.Sprintf("e%d", i); protocol.ShardOf(cand, 8) == s {
					id = cand
					return true
				}
			}
		}
		return false
	})
	js := natstest.JetStream(t, natstest.Connect(t, url))
	const n = 50
	seqs := publishIncrs(t, js, id, 8, 1)
	<-entered
	seqs = append(seqs, publishIncrs(t, js, id, 8, n-1)...)
	natstest.Eventually(t, 30*time.Second, "every message handed to b's entity", func() bool {
		st, _ := b.Stats("kv")
		return st.Delivered >= n
	})
	close(release)
	<-died
	if got := g.written(); len(got) < 2 || got[1] != seqs[n-1] {
		t.Fatalf("b's writes applied sequences %v, want its second to store the run up to %d", got, seqs[n-1])
	}
	wantCount(t, natshard.NewClient(natstest.Connect(t, url)), id, n)
}

// wrapped is an entity around another that does not pass Flush on.
type wrapped struct{ natshard.Entity }

// TestDurableKVWrappedStoresEachMessage: a kv entity wrapped in an entity
// that is no Flusher is never flushed, so it stores each message itself
// (WillFlush is false), as before group commit.
func TestDurableKVWrappedStoresEachMessage(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	g := &writeGate{}
	kv := writeGatedKV(g)
	typ := natshard.Type{Name: "kv", Kind: "kv", Shards: 8, Entity: func(ctx context.Context, id string) (natshard.Entity, error) {
		e, err := kv(ctx, id)
		if err != nil {
			return nil, err
		}
		return wrapped{e}, nil
	}}
	node := durableNode(t, url, "a", typ)
	natstest.Eventually(t, 30*time.Second, "a to hold the 8 shards", func() bool { st, _ := node.Stats("kv"); return len(st.Shards) == 8 })
	const n = 20
	seqs := publishIncrs(t, natstest.JetStream(t, natstest.Connect(t, url)), "e0", 8, n)
	wantCount(t, natshard.NewClient(natstest.Connect(t, url)), "e0", n)
	if got := g.written(); !slices.Equal(got, seqs) {
		t.Fatalf("writes with applied sequences %v, want one per message %v", got, seqs)
	}
}
