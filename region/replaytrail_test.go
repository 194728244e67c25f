package region

import (
	"context"
	"testing"
	"time"
)

// The replay's trail without NATS: how far the buffer may be purged, and
// when a replay waits.

func kicked(t *replayTrail) bool {
	select {
	case <-t.kick:
		return true
	default:
		return false
	}
}

// TestTrailPurgesOnlyWhatWasHandled: the buffer may be purged up to a
// message once every delivery up to it was handled, whatever order the
// entities finish in; a skipped message moves the point too; a purge
// forgets the deliveries up to it, not those of later messages.
func TestTrailPurgesOnlyWhatWasHandled(t *testing.T) {
	tr := newReplayTrail(4, 2)
	a1 := tr.delivered("a")
	tr.read(10)
	b1 := tr.delivered("") // without a key: not counted, but handled first all the same
	tr.read(11)
	tr.read(12) // skipped: a copy
	a2 := tr.delivered("a")
	tr.read(13)
	if got := tr.next(); got != 0 {
		t.Fatalf("next = %d with nothing handled", got)
	}
	b1() // the second message's entity finishes first
	if got := tr.next(); got != 0 {
		t.Fatalf("next = %d while the first message is not handled", got)
	}
	a1()
	if got := tr.next(); got != 12 {
		t.Fatalf("next = %d, want 12 (the skipped copy after the handled ones)", got)
	}
	// A held arrival delivered before the next message, then it.
	c1 := tr.delivered("c")
	a3 := tr.delivered("a")
	tr.read(14)
	tr.purgedTo(12)
	if got := tr.next(); got != 0 {
		t.Fatalf("next = %d right after the purge", got)
	}
	if len(tr.open) != 2 || tr.open["a"] != 2 || tr.open["c"] != 1 {
		t.Fatalf("open = %v after the purge up to 12, want a:2 c:1", tr.open)
	}
	a2()
	if got := tr.next(); got != 13 {
		t.Fatalf("next = %d, want 13", got)
	}
	a3()
	if got := tr.next(); got != 13 {
		t.Fatalf("next = %d, want 13 while the held arrival before 14 is not handled", got)
	}
	c1()
	if got := tr.next(); got != 14 {
		t.Fatalf("next = %d, want 14", got)
	}
	tr.purgedTo(14)
	if len(tr.open) != 0 || len(tr.recs) != 0 || tr.hot != 0 {
		t.Fatalf("after the last purge: open %v, %d records, %d hot", tr.open, len(tr.recs), tr.hot)
	}
}

// TestTrailWaitsAtItsLimit: a replay waits while the entity has limit
// counted deliveries in the buffer, asks for a purge once an entity has
// soon of them and the purge would take limit-soon, and goes on once the
// purge is recorded; another entity, or a message without a key, does
// not wait.
func TestTrailWaitsAtItsLimit(t *testing.T) {
	tr := newReplayTrail(4, 2)
	ctx := t.Context()
	var dones []func()
	for seq := uint64(1); seq <= 4; seq++ {
		if ok, _ := tr.wait(ctx, "a", time.Minute); !ok {
			t.Fatal("wait before the limit")
		}
		dones = append(dones, tr.delivered("a"))
		tr.read(seq)
		if seq == 1 && kicked(tr) {
			t.Fatal("a purge asked for with one delivery")
		}
	}
	if ok, _ := tr.wait(ctx, "b", time.Minute); !ok {
		t.Fatal("another entity waited")
	}
	if ok, _ := tr.wait(ctx, "", time.Minute); !ok {
		t.Fatal("a message without a key waited")
	}
	dones[0]()
	if kicked(tr) {
		t.Fatal("a purge asked for that would take one delivery")
	}
	dones[1]()
	if !kicked(tr) {
		t.Fatal("no purge asked for with half the limit handled")
	}
	waited := make(chan bool)
	go func() {
		ok, gaveUp := tr.wait(ctx, "a", time.Minute)
		waited <- ok && !gaveUp
	}()
	select {
	case <-waited:
		t.Fatal("wait returned at the limit")
	case <-time.After(20 * time.Millisecond):
	}
	up := tr.next()
	if up != 2 {
		t.Fatalf("next = %d, want 2", up)
	}
	tr.purgedTo(up)
	if ok := <-waited; !ok {
		t.Fatal("wait did not go on after the purge")
	}

	// At the limit again: an ended context, then patience running out.
	tr.delivered("a")
	tr.delivered("a")
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if ok, _ := tr.wait(cctx, "a", time.Minute); ok {
		t.Fatal("wait went on with its context ended")
	}
	ok, gaveUp := tr.wait(ctx, "a", 10*time.Millisecond)
	if !ok || !gaveUp {
		t.Fatalf("wait = %v, %v past its patience, want true, true", ok, gaveUp)
	}
	if ok, gaveUp := tr.wait(ctx, "a", time.Hour); !ok || gaveUp {
		t.Fatalf("wait after giving up = %v, %v, want at once true, false", ok, gaveUp)
	}
}
