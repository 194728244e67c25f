package coordinator

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// Scenarios of the rebalance rounds (issue 17, docs/PROTOCOL.md, "Rebalance
// and leaving"): a round plans every move the strategy asks for and runs them
// as moves in flight end, within MaxMoves; Akka's gates (membership settled,
// one plan at a time, versions) hold. Ticks are the logical clock: the sim
// answers every command at once, so a plan runs within the tick it started in.

// defaultsConfig is the coordinator's default configuration in ticks of
// DefaultTick, with the default strategy.
func defaultsConfig(shards int) CoreConfig {
	tick := func(d interface{ Milliseconds() int64 }) int {
		return int(d.Milliseconds() / DefaultTick.Milliseconds())
	}
	return CoreConfig{
		Shards:         shards,
		Strategy:       strategies.NewLeastShard(strategies.DefaultAbsoluteLimit, strategies.DefaultRelativeLimit),
		ProbeEvery:     tick(DefaultProbeInterval),
		Retry:          10,
		HandOffTimeout: tick(DefaultHandOffTimeout),
		RebalanceEvery: tick(DefaultRebalanceInterval),
		Settle:         tick(DefaultSettle),
		MaxMoves:       DefaultMaxMoves,
	}
}

// maxInFlight records the most moves in flight whenever a command is sent.
func maxInFlight(s *sim) *int {
	n := new(int)
	s.intercept = func(Send) (CommandDone, bool) {
		*n = max(*n, s.c.moving)
		return CommandDone{}, false
	}
	return n
}

// TestJoin1024OneRound: 1 024 shards on three regions, a fourth joins.
// With the defaults one round moves 256 shards, each once, all to the new
// region, never more than MaxMoves at once, and the regions are balanced
// as soon as membership has settled.
func TestJoin1024OneRound(t *testing.T) {
	cfg := defaultsConfig(1024)
	cfg.MinRegions = 3
	s := newSim(t, cfg)
	for _, r := range []string{"a", "b", "c"} {
		s.join(r)
	}
	s.settled()
	s.ticks(cfg.RebalanceEvery)
	if len(s.rounds) != 0 {
		t.Fatalf("rounds on balanced regions: %+v", s.rounds)
	}
	before := s.c.Table()
	inFlight := maxInFlight(s)
	s.join("d")
	s.ticks(cfg.Settle)
	s.settled()
	if c := s.counts(); spread(c) > 0 || c["d"] != 256 {
		t.Fatalf("after the settle window: %v, want 256 each", c)
	}
	if len(s.rounds) != 1 || len(s.rounds[0].Moves) != 256 {
		t.Fatalf("%d rounds (%+v), want one of 256 moves", len(s.rounds), s.rounds)
	}
	if r := s.rounds[0].Regions; r["a"] != 342 || r["d"] != 0 {
		t.Fatalf("round reported regions %v", r)
	}
	if len(s.done) != 1 || s.done[0] != (RoundDone{Round: 1, Moved: 256}) {
		t.Fatalf("rounds done %+v", s.done)
	}
	if *inFlight != cfg.MaxMoves {
		t.Fatalf("at most %d moves in flight, want the bound %d reached and kept", *inFlight, cfg.MaxMoves)
	}
	for sh, rec := range s.c.Table() {
		if rec.Region != before[sh].Region && rec.Region != "d" {
			t.Fatalf("shard %d moved from %s to %s, not to the new region", sh, before[sh].Region, rec.Region)
		}
	}
	// The next rounds find nothing to move, and say so once.
	s.noRounds = nil
	s.ticks(3 * cfg.RebalanceEvery)
	if len(s.rounds) != 1 || !slices.Equal(s.noRounds, []string{"the strategy moves nothing: balanced"}) {
		t.Fatalf("rounds %d, reasons for none %q", len(s.rounds), s.noRounds)
	}
}

// TestStartupRegionsApart: three regions start two seconds apart; the
// first takes every shard at once (nothing waits), each later one gets its
// share from one round after the settle window, and the follow-up round,
// at the next tick, evens out the last shard.
func TestStartupRegionsApart(t *testing.T) {
	cfg := defaultsConfig(1024)
	s := newSim(t, cfg)
	apart := 2 * cfg.RebalanceEvery / 2 // 2 s in ticks
	s.join("r1")
	s.settled()
	if c := s.counts(); c["r1"] != 1024 {
		t.Fatalf("the first region holds %v", c)
	}
	s.ticks(apart)
	s.join("r2")
	s.ticks(apart)
	s.join("r3")
	s.ticks(cfg.Settle)
	s.settled()
	if c := s.counts(); spread(c) > 2 {
		t.Fatalf("a settle window after the last start: %v", c)
	}
	s.ticks(1)
	s.settled()
	if c := s.counts(); spread(c) > 1 {
		t.Fatalf("a tick later: %v", c)
	}
	moves := 0
	for _, r := range s.rounds {
		moves += len(r.Moves)
	}
	if len(s.rounds) > 3 || moves > 512+342+1 {
		t.Fatalf("%d rounds, %d moves", len(s.rounds), moves)
	}
	t.Logf("%d rounds, %d moves", len(s.rounds), moves)
}

// flipper is a strategy that never settles: every round it moves the
// lowest shard of the region that holds it.
type flipper struct{ strategies.Strategy }

func (flipper) Rebalance(regions []strategies.Region, inProgress []int) ([]int, error) {
	if len(inProgress) > 0 {
		return nil, nil
	}
	low := -1
	for _, r := range regions {
		for _, sh := range r.Shards {
			if low < 0 || sh < low {
				low = sh
			}
		}
	}
	return []int{low}, nil
}

// TestFollowUpRoundsBounded: a round that moved shards is followed at once
// by another, but a strategy that never settles gets 1+maxFollowUps rounds
// in a row, then one per RebalanceEvery.
func TestFollowUpRoundsBounded(t *testing.T) {
	cfg := defaultsConfig(4)
	cfg.Strategy = flipper{cfg.Strategy}
	cfg.MinRegions = 2
	s := newSim(t, cfg)
	s.join("a")
	s.join("b")
	s.ticks(cfg.Settle + 10)
	if len(s.rounds) != 1+maxFollowUps {
		t.Fatalf("%d rounds in a row, want %d", len(s.rounds), 1+maxFollowUps)
	}
	s.ticks(4 * cfg.RebalanceEvery)
	if len(s.rounds) != 1+maxFollowUps+4 {
		t.Fatalf("%d rounds after 4 intervals, want %d", len(s.rounds), 1+maxFollowUps+4)
	}
	s.settled()
}

// TestMembershipChangeDropsThePlan: a region joins while a round's moves
// run; the round starts no more of them, the next round waits for the
// settle window and plans for the new membership.
func TestMembershipChangeDropsThePlan(t *testing.T) {
	cfg := defaultsConfig(64)
	cfg.MaxMoves = 4
	cfg.MinRegions = 2
	s := newSim(t, cfg)
	s.join("a")
	s.join("b")
	s.ticks(cfg.RebalanceEvery)
	// Sources pause only when told to on a later tick: moves stay in flight.
	slow := true
	s.intercept = func(send Send) (CommandDone, bool) {
		if slow && send.Command.Kind == protocol.CmdHandOff {
			return CommandDone{Send: send, Outcome: Failed}, true
		}
		return CommandDone{}, false
	}
	s.join("c")
	s.ticks(cfg.Settle)
	if len(s.rounds) != 1 || len(s.rounds[0].Moves) != 20 || s.c.moving != 4 {
		t.Fatalf("rounds %+v, %d in flight; want one round of 20 moves, 4 in flight", s.rounds, s.c.moving)
	}
	s.join("d")
	slow = false
	s.ticks(cfg.Retry)
	if len(s.done) != 1 || s.done[0].Moved != 4 || s.done[0].Dropped != 16 || s.done[0].Reason != "membership changed" {
		t.Fatalf("rounds done %+v, want 4 moved, 16 dropped as membership changed", s.done)
	}
	s.ticks(cfg.Settle)
	s.settled()
	if c := s.counts(); spread(c) > 0 || len(s.rounds) != 2 {
		t.Fatalf("%v after %d rounds, want 16 each after 2", c, len(s.rounds))
	}
}

// TestMixedVersionsNoRound: no round moves anything while the regions run
// different versions (a rolling update); the reason is reported once.
func TestMixedVersionsNoRound(t *testing.T) {
	cfg := defaultsConfig(16)
	s := newSim(t, cfg)
	s.join("a")
	s.run(s.c.Step(RegionUp{RegionSeen{Info: protocol.RegionInfo{ID: "b", Incarnation: "b-1", Version: "2.0"}, Revision: 1}}))
	s.regions["b"] = &simRegion{id: "b", inc: "b-1", modes: map[int]string{}, holdFor: map[int]uint64{}, rates: map[int]float64{}}
	s.ticks(5 * cfg.RebalanceEvery)
	s.settled()
	if c := s.counts(); c["a"] != 16 || len(s.rounds) != 0 {
		t.Fatalf("%v, %d rounds: a rolling update rebalanced", c, len(s.rounds))
	}
	n := 0
	for _, r := range s.noRounds {
		if strings.Contains(r, "different versions [ 2.0]") {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("reasons %q, want the versions once", s.noRounds)
	}
}

// TestOperatorRoundRunsWholePlan: shardctl rebalance plans every move and
// starts them as moves in flight allow; the answer lists them all.
func TestOperatorRoundRunsWholePlan(t *testing.T) {
	cfg := defaultsConfig(90)
	cfg.RebalanceEvery, cfg.MaxMoves, cfg.MinRegions = -1, 5, 2
	s := newSim(t, cfg)
	s.join("a")
	s.join("b")
	s.join("c")
	inFlight := maxInFlight(s)
	ans, acts := s.c.Rebalance(false)
	s.run(acts)
	s.settled()
	if len(ans.Moves) != 30 || *inFlight > cfg.MaxMoves {
		t.Fatalf("%d moves planned, %d in flight at most", len(ans.Moves), *inFlight)
	}
	for _, m := range ans.Moves {
		if s.owner(m.Shard) != m.To || m.To != "c" {
			t.Fatalf("shard %d on %s, planned %s", m.Shard, s.owner(m.Shard), m.To)
		}
	}
	if c := s.counts(); spread(c) > 0 {
		t.Fatal(fmt.Sprint(c))
	}
}
