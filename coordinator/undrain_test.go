package coordinator

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/natshard/natshard/protocol"
)

// TestUndrain: undrain is refused for a region that is unknown or still
// holds shards (being drained, or stopping: the core cannot tell); for a
// drained region it sends CmdUndrain, and once the region's registration
// is no longer leaving a rebalance round gives it shards again.
func TestUndrain(t *testing.T) {
	s, _ := twoRegions(t, nil)
	refused := func(region string, want error, text string) {
		t.Helper()
		table := s.c.Table()
		acts, note, err := s.c.Undrain(region)
		if !errors.Is(err, want) || !strings.Contains(err.Error(), text) || acts != nil || note != "" {
			t.Fatalf("Undrain(%q): %v %q %v, want %v with %q", region, acts, note, err, want, text)
		}
		if !slices.Equal(table, s.c.Table()) {
			t.Fatalf("a refused Undrain(%q) changed the table", region)
		}
	}
	refused("c", ErrUnknownRegion, `"c"`)
	refused("c d", ErrBadRequest, "invalid name")
	if acts, note, err := s.c.Undrain("a"); err != nil || len(acts) != 0 || note != "region a is not leaving" {
		t.Fatalf("Undrain of a region that is not leaving: %v %q %v", acts, note, err)
	}

	// a leaves (a drain, or its process stops): while it holds shards
	// (the sources of moves that have not paused yet), undrain is refused.
	s.intercept = func(send Send) (CommandDone, bool) {
		return CommandDone{Send: send, Outcome: Failed}, send.Command.Kind == protocol.CmdHandOff
	}
	s.leave("a")
	refused("a", ErrRegionBusy, "region a still holds 4 shards")
	s.intercept = nil
	s.ticks(20)
	s.settled()
	if n := s.counts()["a"]; n != 0 {
		t.Fatalf("a holds %d shards after leaving", n)
	}
	acts, note, err := s.c.Undrain("a")
	if err != nil || !strings.Contains(note, "takes shards again") {
		t.Fatalf("Undrain of a drained region: %q %v", note, err)
	}
	if !slices.ContainsFunc(acts, func(a Action) bool {
		send, ok := a.(Send)
		return ok && send.Region == "a" && send.Command.Kind == protocol.CmdUndrain
	}) {
		t.Fatalf("Undrain sent no CmdUndrain to a: %v", acts)
	}
	s.run(acts)
	if plan, _ := s.c.Rebalance(true); len(plan.Moves) != 0 {
		t.Fatalf("a round plans moves to a region still leaving: %+v", plan)
	}
	// The region clears the flag in its registration.
	s.run(s.c.Step(RegionUp{RegionSeen{Info: protocol.RegionInfo{ID: "a", Incarnation: s.regions["a"].inc}, Revision: 3}}))
	_, acts = s.c.Rebalance(false)
	s.run(acts)
	s.ticks(20)
	s.settled()
	if c := s.counts(); c["a"] != 4 || c["b"] != 4 {
		t.Fatalf("after undrain and a round: %v", c)
	}
}
