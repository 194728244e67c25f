package natshard_test

import (
	"context"
	"errors"
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
