package kvstate

import (
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// testPins: pins are written fenced on the coordinator lease, read back
// whole by another handle, removed idempotently, and a coordinator whose
// lease moved on can neither add nor remove one.
func testPins(t *testing.T, newStore func(t *testing.T) *Store) {
	a := newStore(t)
	b := peer(t, a, "")
	ctx := t.Context()
	wantPins := func(s *Store, want map[int]string) {
		t.Helper()
		got, err := s.Pins(ctx)
		if err != nil || !maps.Equal(got, want) {
			t.Fatalf("Pins = %v, %v; want %v", got, err, want)
		}
	}
	wantPins(a, map[int]string{})

	l1, err := a.AcquireCoordinator(ctx, coordInfo("a"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for sh, r := range map[int]string{3: "b", 7: "c", 0: "a"} {
		if _, err := a.PutPin(ctx, l1, sh, r); err != nil {
			t.Fatalf("PutPin(%d, %s): %v", sh, r, err)
		}
	}
	if _, err := a.PutPin(ctx, l1, 3, "d"); err != nil {
		t.Fatalf("PutPin over a pin: %v", err)
	}
	wantPins(b, map[int]string{0: "a", 3: "d", 7: "c"})
	for range 2 { // idempotent
		if err := a.DeletePin(ctx, l1, 7); err != nil {
			t.Fatalf("DeletePin: %v", err)
		}
	}
	if err := a.DeletePin(ctx, l1, 100); err != nil {
		t.Fatalf("DeletePin of a shard never pinned: %v", err)
	}
	wantPins(b, map[int]string{0: "a", 3: "d"})

	// The lease moves on: the old revision is fenced out.
	l2, err := a.Renew(ctx, l1, coordInfo("a"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.PutPin(ctx, l1, 5, "x"); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutPin with a stale lease: %v, want ErrFenced", err)
	}
	if err := a.DeletePin(ctx, l1, 3); !errors.Is(err, ErrFenced) {
		t.Fatalf("DeletePin with a stale lease: %v, want ErrFenced", err)
	}
	// Another coordinator takes over after a release and reads the pins.
	if err := a.Release(ctx, l2); err != nil {
		t.Fatal(err)
	}
	l3, err := b.AcquireCoordinator(ctx, coordInfo("b"), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.PutPin(ctx, l2, 5, "x"); !errors.Is(err, ErrFenced) {
		t.Fatalf("PutPin of the deposed coordinator: %v, want ErrFenced", err)
	}
	wantPins(b, map[int]string{0: "a", 3: "d"})
	if err := b.DeletePin(ctx, l3, 0); err != nil {
		t.Fatal(err)
	}
	wantPins(a, map[int]string{3: "d"})

	// Bad input is refused before anything is written.
	for _, tc := range []struct {
		fence  Lease
		shard  int
		region string
	}{
		{l3, 1, "a b"},
		{l3, 1, ""},
		{l3, -1, "a"},
		{l3, protocol.MaxShards, "a"},
		{Lease{Key: KeyCoordinator}, 1, "a"},
		{Lease{Key: "regions.x", Revision: l3.Revision}, 1, "a"},
	} {
		if _, err := b.PutPin(ctx, tc.fence, tc.shard, tc.region); err == nil {
			t.Errorf("PutPin(%+v, %d, %q) succeeded", tc.fence, tc.shard, tc.region)
		}
	}
	// Values that do not decode, or that name another shard than their
	// key, are left out.
	if _, err := a.kv.Put(ctx, "pins.9", []byte("garbage")); err != nil {
		t.Fatal(err)
	}
	other, _ := protocol.Encode(protocol.Pin{Shard: 11, Region: "z"})
	if _, err := a.kv.Put(ctx, "pins.10", other); err != nil {
		t.Fatal(err)
	}
	wantPins(b, map[int]string{3: "d"})
}
