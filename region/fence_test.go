package region_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestZombieSourceFenced (issue 30, violation A), step by step: the test
// plays the coordinator of a forced reallocation. Region a serves shard X
// and freezes (its connection goes through a proxy that stops forwarding
// both ways, as a SIGSTOPped process looks to the server); the handoff
// command reaches it only when it thaws. Meanwhile the coordinator gives
// up on it: it fences the handoff, diverts X itself (untagged appends) and
// binds X to b, which replays what it diverts. Then a thaws, still owning X
// as far as it knows, and pauses it for the old handoff, with the messages
// published during its freeze queued. The drop that the coordinator sent
// is held back until a has answered (in the campaign a had appended its
// backlog before it got to the drop).
//
// Before the fence, a purged the buffer and appended its backlog behind
// the coordinator's messages, and b applied keyed messages out of order
// ([48 49 50 70 57 58 ...] in the campaign). Now a finds the fence as it
// pauses, leaves the buffer alone and drops X; b applies every keyed
// message at most once and in publish order, and a serves nothing of X
// from its thaw on.
func TestZombieSourceFenced(t *testing.T) {
	c := newCluster(t, kvstate.BufferOptions{})
	a, _, proxy := c.addProxiedAgent("a")
	c.addAgent("b", nil)
	const id = "zombie"
	x := protocol.ShardOf(id, shards)
	c.allocate("a", x)

	var sent atomic.Int64
	stop := make(chan struct{})
	published := make(chan struct{})
	go func() {
		defer close(published)
		for seq := 1; ; seq++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
			if err := c.nc.PublishMsg(c.message(id, seq, true)); err != nil {
				t.Error(err)
				return
			}
			sent.Store(int64(seq))
		}
	}()
	handledBy := func(region string) []int {
		c.rec.mu.Lock()
		defer c.rec.mu.Unlock()
		var out []int
		for _, m := range c.rec.log[id] {
			if m.region == region {
				var n int
				fmt.Sscan(m.payload, &n)
				out = append(out, n)
			}
		}
		return out
	}
	natstest.Eventually(t, 30*time.Second, "a to serve the shard", func() bool { return len(handledBy("a")) >= 20 })

	proxy.Freeze()
	frozenAt := sent.Load()
	h := c.newHandoffs(1)
	handoff := protocol.Command{Kind: protocol.CmdHandOff, Shards: []int{x}, Handoffs: h, Epoch: c.epoch, Incarnation: c.incs["a"]}
	data, err := protocol.Encode(handoff)
	if err != nil {
		t.Fatal(err)
	}
	inbox := nats.NewInbox()
	answers, err := c.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.nc.PublishRequest(c.subjects.Region("a"), inbox, data); err != nil {
		t.Fatal(err)
	}
	// The handoff times out: what is published meanwhile reaches only a's
	// (frozen) subscription. Then the coordinator fences the handoff and
	// diverts.
	natstest.Eventually(t, 30*time.Second, "the handoff timeout (messages only a's subscription gets)", func() bool { return sent.Load() >= frozenAt+100 })
	if _, err := c.buffer.Fence(context.Background(), x, h[0]); err != nil {
		t.Fatal(err)
	}
	parked := make(chan struct{})
	park, err := c.nc.Subscribe(c.subjects.Shard(x), func(m *nats.Msg) {
		c.buffer.Append(x, m, func(m *nats.Msg, err error) { t.Errorf("park %s: %v", m.Data, err) })
	})
	if err != nil {
		t.Fatal(err)
	}
	park.SetClosedHandler(func(string) { close(parked) })
	if err := c.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	c.must("b", protocol.Command{Kind: protocol.CmdBind, Shards: []int{x}, Handoffs: h})
	natstest.Eventually(t, 30*time.Second, "b to replay what the coordinator diverts", func() bool { return len(handledBy("b")) >= 100 })

	proxy.Thaw()
	thawedAt := sent.Load()
	servedBeforeThaw := len(handledBy("a"))
	m, err := answers.NextMsg(30 * time.Second)
	if err != nil {
		t.Fatalf("a's answer to the old handoff: %v", err)
	}
	var r protocol.Reply
	if err := protocol.Decode(m.Data, &r); err != nil {
		t.Fatal(err)
	}
	// What a appends now reaches the buffer before the coordinator's end
	// marker: let some messages go by (the publisher is the clock).
	answeredAt := sent.Load()
	natstest.Eventually(t, 30*time.Second, "more messages published", func() bool { return sent.Load() >= answeredAt+200 })
	c.must("a", protocol.Command{Kind: protocol.CmdDrop, Shards: []int{x}})
	natstest.Eventually(t, 30*time.Second, "a to drop the shard", func() bool { return !slices.Contains(a.Held(), x) })
	servedByA := len(handledBy("a"))

	// The coordinator ends its parking (drain), then writes the end marker.
	if err := park.Drain(); err != nil {
		t.Fatal(err)
	}
	<-parked
	if _, err := c.buffer.Mark(context.Background(), x, h[0]); err != nil {
		t.Fatal(err)
	}
	close(stop)
	<-published
	last := int(sent.Load())
	natstest.Eventually(t, 30*time.Second, "b to handle the last message", func() bool { return slices.Contains(handledBy("b"), last) })

	st := a.Stats()
	got := handledBy("b")
	t.Logf("froze after %d messages, thawed after %d; a answered %+v, served %d messages of the shard after the thaw (before its pause), appended %d, dropped the shard as fenced %d times; b handled %d of %d, from %d",
		frozenAt, thawedAt, r, servedByA-servedBeforeThaw, st.Buffered.Load(), st.SourceFenced.Load(), len(got), last, got[0])
	if n := len(handledBy("a")); n != servedByA {
		t.Errorf("a handled %d messages of the shard after it dropped it", n-servedByA)
	}
	for i := 1; i < len(got); i++ {
		if got[i] <= got[i-1] {
			t.Fatalf("b applied keyed message %d after %d (at %d of %d): %v", got[i], got[i-1], i, len(got), got[max(0, i-10):min(len(got), i+10)])
		}
	}
}
