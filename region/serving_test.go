package region_test

import (
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// closed reports whether ch is closed.
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// closedSoon reports whether ch closes within a few seconds. The driver
// closes Serving's old channel just after it stores the new view (so a
// goroutine woken by the close reads the new state), so a test that saw
// the new state from another goroutine may read the old channel a moment
// before it closes.
func closedSoon(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	case <-time.After(5 * time.Second):
		return false
	}
}

// TestServing (issue 31, daemons): a region serves a shard (Serving) only
// while it is live there, registered and connected: not while it replays
// the buffer, from the moment its connection drops until the table
// confirmed it, nor from the moment its handoff began; each change closes
// the channel Serving gave before.
func TestServing(t *testing.T) {
	c := newCluster(t, kvstate.BufferOptions{})
	a := c.addAgent("a", nil)
	b := c.addAgent("b", nil)
	const shard = 4
	if ok, _ := a.Serving(shard); ok {
		t.Fatal("a serves a shard it was never given")
	}

	// Bound but replaying (no end marker yet): not served.
	hs := c.newHandoffs(1)
	c.putRow(protocol.ShardRecord{Shard: shard, State: protocol.StateBinding, Region: "a", Incarnation: c.incs["a"], Handoff: hs[0]})
	c.must("a", protocol.Command{Kind: protocol.CmdBind, Shards: []int{shard}, Handoffs: hs})
	ok, changed := a.Serving(shard)
	if ok {
		t.Fatal("a serves a shard it is replaying")
	}
	if _, err := c.buffer.Mark(t.Context(), shard, hs[0]); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 30*time.Second, "the shard served by a once live", func() bool { ok, _ := a.Serving(shard); return ok })
	if !closedSoon(changed) {
		t.Error("the shard went live without closing Serving's channel")
	}
	c.putRow(protocol.ShardRecord{Shard: shard, State: protocol.StateActive, Region: "a", Incarnation: c.incs["a"], Order: 1})

	// The connection drops: not served at once, until confirmed.
	_, changed = a.Serving(shard)
	a.Suspend("test")
	if ok, _ := a.Serving(shard); ok || !closed(changed) {
		t.Fatalf("a suspended region serves its shard (%v), or did not say so (channel closed: %v)", ok, closed(changed))
	}
	_, changed = a.Serving(shard)
	a.Reconnected()
	natstest.Eventually(t, 30*time.Second, "the shard served by a again once confirmed", func() bool { ok, _ := a.Serving(shard); return ok })
	if !closedSoon(changed) {
		t.Error("the confirmation did not close Serving's channel")
	}

	// A handoff: not served from the moment it is decided.
	_, changed = a.Serving(shard)
	hs = c.newHandoffs(1)
	c.handOff("a", []int{shard}, hs)
	if ok, _ := a.Serving(shard); ok || !closed(changed) {
		t.Fatalf("a serves the shard it handed off (%v), or did not say so (channel closed: %v)", ok, closed(changed))
	}
	c.must("b", protocol.Command{Kind: protocol.CmdBind, Shards: []int{shard}, Handoffs: hs})
	c.must("a", protocol.Command{Kind: protocol.CmdRelease, Shards: []int{shard}, Handoffs: hs})
	natstest.Eventually(t, 30*time.Second, "the shard served by b", func() bool { ok, _ := b.Serving(shard); return ok })

	// A fence: nothing served.
	_, changed = b.Serving(shard)
	b.Fence("test")
	if ok, _ := b.Serving(shard); ok || !closed(changed) {
		t.Fatalf("a fenced region serves its shard (%v), or did not say so (channel closed: %v)", ok, closed(changed))
	}
}
