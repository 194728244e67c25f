package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
)

type cart struct {
	Items map[string]int `json:"items"`
}

func add(item string) func(*cart) error {
	return func(c *cart) error {
		if c.Items == nil {
			c.Items = map[string]int{}
		}
		c.Items[item]++
		return nil
	}
}

// TestState: Update saves before it keeps; a failed change or save leaves
// the state as it was; a conflict (another writer, such as a previous
// owner of the shard) reloads and applies the change once more; Delete.
func TestState(t *testing.T) {
	ctx := context.Background()
	store, err := kvstate.Open(ctx, natstest.JetStream(t, natstest.Connect(t, natstest.URL(natstest.RunServer(t)))), "carts", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := natshard.OpenState[cart](ctx, store, "alice")
	if err != nil || s.Revision() != 0 || s.Value().Items != nil {
		t.Fatalf("new state: %+v at %d, %v", s.Value(), s.Revision(), err)
	}
	if err := s.Update(ctx, add("apple")); err != nil {
		t.Fatal(err)
	}
	if data, rev, err := store.LoadEntity(ctx, "alice"); err != nil || string(data) != `{"items":{"apple":1}}` || rev != s.Revision() {
		t.Fatalf("stored %s at %d, %v; state at %d", data, rev, err, s.Revision())
	}

	// A change that fails changes nothing, even what it touched.
	boom := errors.New("boom")
	err = s.Update(ctx, func(c *cart) error { c.Items["pear"] = 9; return boom })
	if !errors.Is(err, boom) || len(s.Value().Items) != 1 {
		t.Fatalf("failed change: %v, state %+v", err, s.Value())
	}

	// Another writer came first: theirs is reloaded and the change applied
	// to it.
	other, err := natshard.OpenState[cart](ctx, store, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Update(ctx, add("kiwi")); err != nil {
		t.Fatal(err)
	}
	calls := 0
	if err := s.Update(ctx, func(c *cart) error { calls++; return add("apple")(c) }); err != nil {
		t.Fatal(err)
	}
	if got := s.Value().Items; calls != 2 || got["apple"] != 2 || got["kiwi"] != 1 {
		t.Fatalf("after a conflict: %v, change called %d times", got, calls)
	}

	// A save that fails otherwise leaves the state as stored.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := s.Update(cctx, add("plum")); err == nil || s.Value().Items["plum"] != 0 {
		t.Fatalf("failed save: %v, state %+v", err, s.Value())
	}

	if err := s.Delete(ctx); err != nil || s.Revision() != 0 || s.Value().Items != nil {
		t.Fatalf("Delete: %v, %+v at %d", err, s.Value(), s.Revision())
	}
	if _, _, err := store.LoadEntity(ctx, "alice"); !errors.Is(err, natshard.ErrNotFound) {
		t.Fatalf("after Delete: %v", err)
	}
	if _, err := natshard.LoadState[cart](ctx); err == nil {
		t.Fatal("LoadState outside a Factory's context succeeded")
	}
}

// counterEntity counts with a State and answers the count, saved with it
// (UpdateAnswer); changes counts the calls of its change.
type counterEntity struct {
	state   *natshard.State[int]
	changes *atomic.Int32
}

func (e counterEntity) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	return e.state.UpdateAnswer(ctx, m, func(n *int) ([]byte, error) {
		e.changes.Add(1)
		*n++
		return fmt.Appendf(nil, "%d", *n), nil
	})
}
func (counterEntity) Stop(context.Context) error { return nil }

// TestStateUpdateAnswer: UpdateAnswer saves a keyed change's answer with
// the state; the next process to host the entity (the first closed)
// answers the key sent again with it, without applying it, and a State
// opened on the same store finds it; a message without a key, or with
// another, is applied.
func TestStateUpdateAnswer(t *testing.T) {
	ctx := context.Background()
	url := natstest.URL(natstest.RunServer(t))
	var changes atomic.Int32
	typ := natshard.Type{Name: "counters", Shards: 4, Entity: func(ctx context.Context, _ string) (natshard.Entity, error) {
		s, err := natshard.LoadState[int](ctx)
		if err != nil {
			return nil, err
		}
		return counterEntity{state: s, changes: &changes}, nil
	}}
	c := natshard.NewClient(natstest.Connect(t, url))
	a := mustStartOn(t, url, "a", typ)
	first, err := c.Request(ctx, "counters", "c1", nil, natshard.MsgID("k1"))
	if err != nil || string(first) != "1" {
		t.Fatalf("first: %s, %v", first, err)
	}
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	mustStartOn(t, url, "b", typ)
	if again, err := c.Request(ctx, "counters", "c1", nil, natshard.MsgID("k1")); err != nil || string(again) != "1" {
		t.Fatalf("sent again on another node: %s, %v; want 1", again, err)
	}
	if next, err := c.Request(ctx, "counters", "c1", nil, natshard.MsgID("k2")); err != nil || string(next) != "2" {
		t.Fatalf("another key: %s, %v; want 2", next, err)
	}
	if next, err := c.Request(ctx, "counters", "c1", nil); err != nil || string(next) != "3" {
		t.Fatalf("no key: %s, %v; want 3", next, err)
	}
	if n := changes.Load(); n != 3 {
		t.Fatalf("change called %d times, want 3", n)
	}
	store, err := kvstate.Bind(ctx, natstest.JetStream(t, natstest.Connect(t, url)), "counters", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := natshard.OpenState[int](ctx, store, "c1")
	if err != nil {
		t.Fatal(err)
	}
	if ans, ok := s.Answer("k1"); !ok || string(ans.Data) != "1" {
		t.Fatalf("saved answer of k1: %+v, %v", ans, ok)
	}
}
