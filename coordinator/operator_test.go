package coordinator

import (
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// Scenarios of the operators' requests (issue 4): pins kept by the
// coordinator and given to the external strategy, rebalance rounds on
// demand, and the regions' load reports feeding the load-aware strategy.

// twoRegions starts a and b with 8 shards, rebalancing only on demand:
// a holds the even shards, b the odd ones.
func twoRegions(t *testing.T, strategy strategies.Strategy) (*sim, CoreConfig) {
	t.Helper()
	cfg := testConfig(8)
	if strategy != nil {
		cfg.Strategy = strategy
	}
	cfg.MinRegions = 2
	cfg.RebalanceEvery = -1
	s := newSim(t, cfg)
	s.join("a")
	s.join("b")
	s.settled()
	for sh := range 8 {
		if want := []string{"a", "b"}[sh%2]; s.owner(sh) != want {
			t.Fatalf("shard %d on %s, want %s", sh, s.owner(sh), want)
		}
	}
	return s, cfg
}

func TestPinMovesTheShardHomeInTheNextRound(t *testing.T) {
	s, _ := twoRegions(t, nil)
	acts, note, err := s.c.Pin(1, "a")
	if err != nil || !strings.Contains(note, "moves to a in the next round (periodic rounds are off") {
		t.Fatalf("Pin: %q %v", note, err)
	}
	if !slices.Contains(acts, Action(WritePin{Shard: 1, Region: "a"})) {
		t.Fatalf("Pin did not write the pin: %v", acts)
	}
	s.run(acts)
	if s.owner(1) != "b" {
		t.Fatal("a pin moved the shard before a round")
	}

	// A dry run plans the move and changes nothing.
	before := s.c.Table()
	plan, acts := s.c.Rebalance(true)
	want := []protocol.PlannedMove{{Shard: 1, From: "b", To: "a"}}
	if !slices.Equal(plan.Moves, want) || !plan.DryRun || len(acts) != 0 || !slices.Equal(before, s.c.Table()) {
		t.Fatalf("dry run: %+v, %v", plan, acts)
	}
	plan, acts = s.c.Rebalance(false)
	if !slices.Equal(plan.Moves, want) {
		t.Fatalf("round: %+v, want %v", plan.Moves, want)
	}
	s.run(acts)
	s.settled()
	if s.owner(1) != "a" {
		t.Fatalf("pinned shard 1 on %s", s.owner(1))
	}

	// An operator cannot move a pinned shard elsewhere.
	if _, err := s.c.Move(1, "b"); !errors.Is(err, ErrPinned) || !strings.Contains(err.Error(), "pinned to a") {
		t.Fatalf("Move of a pinned shard: %v", err)
	}
	// Once unpinned, the strategy balances it like any other: a holds 5
	// and b 3, so a round moves one shard from a to b.
	acts, note, err = s.c.Unpin(1)
	if err != nil || !slices.Contains(acts, Action(WritePin{Shard: 1})) || !strings.Contains(note, "stays on a") {
		t.Fatalf("Unpin: %v %q %v", acts, note, err)
	}
	s.run(acts)
	if len(s.pins) != 0 {
		t.Fatalf("pins left: %v", s.pins)
	}
	plan, acts = s.c.Rebalance(false)
	if len(plan.Moves) != 1 || plan.Moves[0].From != "a" || plan.Moves[0].To != "b" {
		t.Fatalf("round after unpin: %+v", plan)
	}
	s.run(acts)
	s.settled()
	if c := s.counts(); c["a"] != 4 || c["b"] != 4 {
		t.Fatalf("want 4+4, got %v", c)
	}
}

func TestPinWaitsForItsRegion(t *testing.T) {
	cfg := testConfig(4)
	cfg.RebalanceEvery = -1
	s := newSim(t, cfg)
	s.join("a")
	s.settled()
	acts, note, err := s.c.Pin(2, "c")
	if err != nil || !strings.Contains(note, "not registered") {
		t.Fatalf("Pin to an absent region: %q %v", note, err)
	}
	s.run(acts)
	if plan, _ := s.c.Rebalance(true); len(plan.Moves) != 0 {
		t.Fatalf("a pin to an absent region moved something: %+v", plan)
	}
	s.join("c")
	plan, acts := s.c.Rebalance(false)
	if len(plan.Moves) == 0 || plan.Moves[0] != (protocol.PlannedMove{Shard: 2, From: "a", To: "c"}) {
		t.Fatalf("round after c joined: %+v", plan)
	}
	s.run(acts)
	s.settled()
	for _, m := range plan.Moves {
		if s.owner(m.Shard) != m.To {
			t.Fatalf("shard %d ended on %s, planned %s", m.Shard, s.owner(m.Shard), m.To)
		}
	}
	// A leaving region's pins are not in force: its shards go elsewhere.
	s.leave("c")
	s.ticks(30)
	s.settled()
	if s.owner(2) != "a" {
		t.Fatalf("shard 2 on %s after its pinned region left", s.owner(2))
	}
}

func TestPinsReadAtTakeover(t *testing.T) {
	cfg := testConfig(6)
	cfg.Pins = map[int]string{1: "b", 2: "b", 99: "a", 3: "bad id"}
	regions := []RegionSeen{
		{Info: protocol.RegionInfo{ID: "a", Incarnation: "a-1"}},
		{Info: protocol.RegionInfo{ID: "b", Incarnation: "b-1"}},
	}
	c, acts := NewCore(cfg, "coord", 1, nil, regions)
	if want := map[int]string{1: "b", 2: "b"}; !maps.Equal(c.Pins(), want) {
		t.Fatalf("pins %v, want %v (invalid ones left out)", c.Pins(), want)
	}
	binds := map[string][]int{}
	for _, a := range acts {
		if s, ok := a.(Send); ok && s.Command.Kind == protocol.CmdBind {
			binds[s.Region] = append(binds[s.Region], s.Command.Shards...)
		}
	}
	// 1 and 2 to b; the others balanced among themselves, as if 1 and 2
	// did not exist: 0 4 to a, 3 5 to b.
	if !slices.Equal(binds["b"], []int{1, 2, 3, 5}) || !slices.Equal(binds["a"], []int{0, 4}) {
		t.Fatalf("first allocation %v", binds)
	}
}

func TestPinRequestsAreChecked(t *testing.T) {
	s, _ := twoRegions(t, nil)
	for _, tc := range []struct {
		shard  int
		region string
	}{{-1, "a"}, {8, "a"}, {1, ""}, {1, "a b"}, {1, "x.y"}} {
		if _, _, err := s.c.Pin(tc.shard, tc.region); !errors.Is(err, ErrBadRequest) {
			t.Errorf("Pin(%d, %q): %v, want ErrBadRequest", tc.shard, tc.region, err)
		}
	}
	if _, _, err := s.c.Unpin(8); !errors.Is(err, ErrBadRequest) {
		t.Errorf("Unpin(8): %v", err)
	}
	if acts, note, err := s.c.Unpin(3); err != nil || len(acts) != 0 || note != "shard 3 was not pinned" {
		t.Errorf("Unpin of an unpinned shard: %v %q %v", acts, note, err)
	}
	if acts, note, _ := s.c.Pin(0, "a"); len(acts) != 1 || note != "shard 0 is on a already" {
		t.Errorf("Pin to the owner: %v %q", acts, note)
	}
	if acts, _, _ := s.c.Pin(0, "a"); len(acts) != 0 {
		t.Errorf("the same pin again writes: %v", acts)
	}
	if len(s.pins) != 0 {
		t.Errorf("refused requests wrote pins: %v", s.pins)
	}
}

func TestLoadReportsDriveTheLoadAwareStrategy(t *testing.T) {
	s, cfg := twoRegions(t, strategies.NewLoadAware(strategies.LoadAwareConfig{}))
	// Without load reports every shard counts the same: 4 and 4 are
	// balanced.
	if plan, _ := s.c.Rebalance(true); len(plan.Moves) != 0 {
		t.Fatalf("moves without loads: %+v", plan)
	}
	a, b := s.regions["a"], s.regions["b"]
	a.rates = map[int]float64{0: 40, 2: 30, 4: 20, 6: 10}
	b.rates = map[int]float64{1: 5, 3: 5, 5: 5, 7: 5}
	b.rates[2] = 1000 // about a shard b does not hold: ignored
	s.ticks(cfg.ProbeEvery)
	// Mean 60; a is at 100, above 60*1.2: its hottest shard goes to b.
	plan, acts := s.c.Rebalance(false)
	if want := []protocol.PlannedMove{{Shard: 0, From: "a", To: "b"}}; !slices.Equal(plan.Moves, want) {
		t.Fatalf("round: %+v, want %v", plan.Moves, want)
	}
	s.run(acts)
	s.settled()
	if s.owner(0) != "b" {
		t.Fatalf("shard 0 on %s", s.owner(0))
	}
	// b has not measured shard 0 yet; the coordinator keeps its last load
	// (40), so b's load is 60 and a's 60: nothing moves back.
	s.ticks(cfg.ProbeEvery)
	var bView strategies.Region
	for _, r := range s.c.strategyView("") {
		if r.ID == "b" {
			bView = r
		}
	}
	if i := slices.Index(bView.Shards, 0); i < 0 || i >= len(bView.Load) || bView.Load[i].MessagesPerSecond != 40 {
		t.Fatalf("b's view %+v: shard 0 lost its load", bView)
	}
	if plan, _ := s.c.Rebalance(true); len(plan.Moves) != 0 {
		t.Fatalf("balanced loads moved: %+v", plan)
	}
}
