package kvstate

import (
	"errors"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// testDaemon: a daemon's worker count is created once (the first count
// stays), read from any peer, scaled only where it exists, and watched:
// the stored count first, then each change.
func testDaemon(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	ctx := t.Context()
	if _, _, err := s.DaemonWorkers(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("DaemonWorkers of a type that is no daemon: %v; want ErrNotFound", err)
	}
	if err := s.ScaleDaemon(ctx, 3); !errors.Is(err, ErrNotFound) {
		t.Fatalf("ScaleDaemon of a type that is no daemon: %v; want ErrNotFound", err)
	}
	if n, err := s.EnsureDaemon(ctx, 4); err != nil || n != 4 {
		t.Fatalf("EnsureDaemon(4) = %d, %v", n, err)
	}
	p := peer(t, s, "")
	if n, err := p.EnsureDaemon(ctx, 7); err != nil || n != 4 {
		t.Fatalf("EnsureDaemon(7) over 4 = %d, %v; want the stored 4", n, err)
	}
	counts, err := p.WatchDaemon(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := func() int {
		t.Helper()
		select {
		case n := <-counts:
			return n
		case <-time.After(10 * time.Second):
			t.Fatal("no count from the watch")
			return 0
		}
	}
	if n := next(); n != 4 {
		t.Fatalf("the watch's first count = %d; want 4", n)
	}
	for _, n := range []int{9, 0, 2} {
		if err := s.ScaleDaemon(ctx, n); err != nil {
			t.Fatal(err)
		}
		if got := next(); got != n {
			t.Fatalf("watched %d after ScaleDaemon(%d)", got, n)
		}
		if got, _, err := p.DaemonWorkers(ctx); err != nil || got != n {
			t.Fatalf("DaemonWorkers = %d, %v; want %d", got, err, n)
		}
	}
	for _, n := range []int{-1, protocol.MaxWorkers + 1} {
		if err := s.ScaleDaemon(ctx, n); err == nil {
			t.Errorf("ScaleDaemon(%d): no error", n)
		}
	}
}

// testWorkerClaims: a worker's claim is taken by compare-and-set on the
// key's last revision (a second claim at the same revision fails), read by
// any peer, released only by the revision that took it, and taken again
// after a release.
func testWorkerClaims(t *testing.T, newStore func(t *testing.T) *Store) {
	s := newStore(t)
	p := peer(t, s, "")
	ctx := t.Context()
	c, rev, err := s.WorkerClaim(ctx, 3)
	if err != nil || c != nil || rev != 0 {
		t.Fatalf("claim of a worker never claimed: %v, %d, %v", c, rev, err)
	}
	a := protocol.WorkerClaim{Region: "a", Instance: "ia"}
	arev, err := s.ClaimWorker(ctx, 3, a, rev)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.ClaimWorker(ctx, 3, protocol.WorkerClaim{Region: "b", Instance: "ib"}, rev); !errors.Is(err, ErrConflict) {
		t.Fatalf("a second claim at the same revision: %v; want ErrConflict", err)
	}
	if c, r, err := p.WorkerClaim(ctx, 3); err != nil || c == nil || *c != a || r != arev {
		t.Fatalf("claim = %v at %d, %v; want %v at %d", c, r, err, a, arev)
	}
	b := protocol.WorkerClaim{Region: "b", Instance: "ib"}
	brev, err := p.ClaimWorker(ctx, 3, b, arev) // taken over, as after a's region was gone for a lease TTL
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ReleaseWorker(ctx, 3, arev); !errors.Is(err, ErrConflict) {
		t.Fatalf("a's release after b took the claim over: %v; want ErrConflict", err)
	}
	if err := p.ReleaseWorker(ctx, 3, brev); err != nil {
		t.Fatal(err)
	}
	c, rev, err = s.WorkerClaim(ctx, 3)
	if err != nil || c != nil || rev <= brev {
		t.Fatalf("claim after its release: %v at %d, %v; want none, at a revision after %d", c, rev, err, brev)
	}
	if _, err := s.ClaimWorker(ctx, 3, a, rev); err != nil {
		t.Fatalf("claim after a release: %v", err)
	}
	if _, _, err := s.WorkerClaim(ctx, protocol.MaxWorkers); err == nil {
		t.Error("a claim of a worker out of range: no error")
	}
}
