package region_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestUndrain: undrain clears the leaving mark that a drain set, in the
// registration, once the region holds no shard; while it holds shards it
// is refused, and so it is for a region whose process is stopping (Leave,
// as shardd does on SIGTERM), which goes on handing its shards off.
func TestUndrain(t *testing.T) {
	c := newCluster(t, kvstate.BufferOptions{})
	c.addAgent("a", nil)
	b := c.addAgent("b", nil)
	c.allocate("a", 0, 1)

	// A drained region that still holds shards refuses.
	c.must("a", protocol.Command{Kind: protocol.CmdLeave})
	r := c.command("a", protocol.Command{Kind: protocol.CmdUndrain})
	if !strings.Contains(r.Error, "still holds shards [0 1]") {
		t.Fatalf("undrain of a region holding shards: %+v", r)
	}
	if info, _ := c.registration("a"); !info.Leaving {
		t.Fatalf("a refused undrain changed the registration: %+v", info)
	}

	// Drained: undrain is obeyed, written before the answer, idempotent.
	c.move([]int{0, 1}, "a", "b")
	c.must("a", protocol.Command{Kind: protocol.CmdUndrain})
	if info, _ := c.registration("a"); info.Leaving {
		t.Fatalf("registration after undrain: %+v", info)
	}
	c.must("a", protocol.Command{Kind: protocol.CmdUndrain})

	// b's process stops: Leave marks it leaving and waits for its shards
	// to go. Undrain is refused, and changes nothing.
	done := make(chan error, 1)
	go func() { done <- b.Leave(context.Background()) }()
	natstest.Eventually(t, 30*time.Second, "b leaving", func() bool { info, _ := c.registration("b"); return info.Leaving })
	r = c.command("b", protocol.Command{Kind: protocol.CmdUndrain})
	if !strings.Contains(r.Error, "undrain refused") {
		t.Fatalf("undrain of a stopping region: %+v", r)
	}
	if info, _ := c.registration("b"); !info.Leaving {
		t.Fatalf("registration of the stopping region after undrain: %+v", info)
	}
	select {
	case err := <-done:
		t.Fatalf("Leave returned %v while b holds shards", err)
	default:
	}
	c.move([]int{0, 1}, "b", "a")
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Leave did not return once b held no shard")
	}
	// Between Leave and Close the process holds no shard, and is still
	// going: undrain is refused all the same.
	r = c.command("b", protocol.Command{Kind: protocol.CmdUndrain})
	if !strings.Contains(r.Error, "process is stopping") {
		t.Fatalf("undrain of a region whose Leave returned: %+v", r)
	}
}
