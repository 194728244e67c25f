package coordinator

import (
	"slices"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// statsScenario is moveScenario with Stats kept.
func statsScenario(t *testing.T, shards int, regions ...string) (*sim, CoreConfig, int, *Stats) {
	t.Helper()
	cfg := testConfig(shards)
	cfg.MinRegions = len(regions)
	cfg.RebalanceEvery = -1
	cfg.Stats = &Stats{}
	s := newSim(t, cfg)
	for _, r := range regions {
		s.join(r)
	}
	sh := slices.IndexFunc(s.c.Table(), func(r protocol.ShardRecord) bool { return r.Region == "a" })
	return s, cfg, sh, cfg.Stats
}

type handoffCounts struct{ started, completed, timedOut, forced uint64 }

func countsOf(st *Stats) handoffCounts {
	return handoffCounts{st.HandOffsStarted.Load(), st.HandOffsCompleted.Load(), st.HandOffsTimedOut.Load(), st.HandOffsForced.Load()}
}

// TestStatsCountHowMovesEnd: each way a move of a live shard ends is
// counted once: completed, timed out (forced reallocation) and forced by
// the loss of its source, pausing or paused.
func TestStatsCountHowMovesEnd(t *testing.T) {
	t.Run("completed", func(t *testing.T) {
		s, _, sh, st := statsScenario(t, 4, "a", "b")
		acts, _ := s.c.Move(sh, "b")
		s.run(acts)
		s.settled()
		if got, want := countsOf(st), (handoffCounts{started: 1, completed: 1}); got != want {
			t.Fatalf("counts %+v, want %+v", got, want)
		}
	})
	t.Run("timed out", func(t *testing.T) {
		s, cfg, sh, st := statsScenario(t, 2, "a", "b")
		s.intercept = func(send Send) (CommandDone, bool) {
			if send.Command.Kind == protocol.CmdHandOff {
				s.regions["a"].modes[sh] = "divert"
				return CommandDone{Send: send, Outcome: OK, Reply: protocol.Reply{Epoch: 1, Incarnation: "a-1"}}, true
			}
			return CommandDone{}, false
		}
		acts, _ := s.c.Move(sh, "b")
		s.run(acts)
		s.ticks(cfg.HandOffTimeout + 1)
		s.settled()
		if got, want := countsOf(st), (handoffCounts{started: 1, timedOut: 1}); got != want {
			t.Fatalf("counts %+v, want %+v", got, want)
		}
	})
	t.Run("source dies pausing", func(t *testing.T) {
		s, _, sh, st := statsScenario(t, 4, "a", "b")
		s.intercept = func(send Send) (CommandDone, bool) {
			if send.Command.Kind == protocol.CmdHandOff && send.Region == "a" {
				s.regions["a"].dead = true
				return CommandDone{Send: send, Outcome: Failed}, true
			}
			return CommandDone{}, false
		}
		acts, _ := s.c.Move(sh, "b")
		s.run(acts)
		s.intercept = nil
		s.deregister("a")
		s.settled()
		if got, want := countsOf(st), (handoffCounts{started: 1, forced: 1}); got != want {
			t.Fatalf("counts %+v, want %+v", got, want)
		}
	})
	t.Run("source dies paused", func(t *testing.T) {
		s, _, sh, st := statsScenario(t, 4, "a", "b")
		s.intercept = func(send Send) (CommandDone, bool) {
			if send.Command.Kind == protocol.CmdRelease && send.Region == "a" {
				s.regions["a"].dead = true
			}
			return CommandDone{}, false
		}
		acts, _ := s.c.Move(sh, "b")
		s.run(acts)
		s.ticks(s.c.cfg.Silence + s.c.cfg.Retry)
		s.settled()
		if got, want := countsOf(st), (handoffCounts{started: 1, forced: 1}); got != want {
			t.Fatalf("counts %+v, want %+v", got, want)
		}
	})
}

// TestStatsCountRounds: a rebalance round that moves shards counts once
// with its moves; a round with nothing to move does not count.
func TestStatsCountRounds(t *testing.T) {
	cfg := testConfig(8)
	cfg.Stats = &Stats{}
	s := newSim(t, cfg)
	s.join("a")
	s.settled()
	s.join("b")
	s.ticks(2*cfg.RebalanceEvery + 1)
	s.settled()
	if r, m := cfg.Stats.Rounds.Load(), cfg.Stats.RoundMoves.Load(); r != 1 || m != 4 {
		t.Fatalf("rounds %d with %d moves, want 1 with 4", r, m)
	}
	if c := s.counts(); c["a"] != 4 || c["b"] != 4 {
		t.Fatalf("shards %v", c)
	}
	s.ticks(3 * cfg.RebalanceEvery)
	if r := cfg.Stats.Rounds.Load(); r != 1 {
		t.Fatalf("balanced rounds counted: %d", r)
	}
	if got := cfg.Stats.HandOffsStarted.Load(); got != 4 {
		t.Fatalf("handoffs started %d, want 4", got)
	}
}

// TestMoveTracker: the tracker times a move from its table writes, counts
// the table by state, and reports an abandoned move and the move of the
// parked shard that follows.
func TestMoveTracker(t *testing.T) {
	st := &Stats{}
	var moves []Move
	t0 := time.Unix(1_700_000_000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	table := []protocol.ShardRecord{
		{Shard: 0, Region: "a", Incarnation: "a1", State: protocol.StateActive, Order: 1},
		{Shard: 2, Region: "b", Incarnation: "b1", State: protocol.StateActive, Order: 2},
	}
	tr := newMoveTracker(st, func(m Move) { moves = append(moves, m) }, 3, table)
	want := map[protocol.ShardState]int64{protocol.StateActive: 2, protocol.StateUnowned: 1, protocol.StateParked: 0, protocol.StateHandoff: 0, protocol.StateBinding: 0}
	if got := st.Shards(); !mapsEqual(got, want) {
		t.Fatalf("shards by state %v, want %v", got, want)
	}
	// Shard 0 moves a -> b: handoff, binding (paused), active.
	tr.written(protocol.ShardRecord{Shard: 0, Region: "a", State: protocol.StateHandoff, Source: "a", Handoff: 5}, at(0))
	tr.written(protocol.ShardRecord{Shard: 0, Region: "b", State: protocol.StateBinding, Source: "a", Handoff: 5}, at(30))
	if got := st.Shards()[protocol.StateBinding]; got != 1 {
		t.Fatalf("binding %d, want 1", got)
	}
	tr.written(protocol.ShardRecord{Shard: 0, Region: "b", State: protocol.StateActive, Order: 5}, at(45))
	// Shard 1 is parked (a new move, from nobody), bound to b, active.
	tr.written(protocol.ShardRecord{Shard: 1, State: protocol.StateParked, Handoff: 6}, at(50))
	tr.written(protocol.ShardRecord{Shard: 1, Region: "b", State: protocol.StateBinding, Handoff: 6}, at(51))
	tr.written(protocol.ShardRecord{Shard: 1, Region: "b", State: protocol.StateActive, Order: 6}, at(60))
	// Shard 2's source dies pausing: parked again (abandoned), then re-homed.
	tr.written(protocol.ShardRecord{Shard: 2, Region: "b", State: protocol.StateHandoff, Source: "b", Handoff: 7}, at(100))
	tr.written(protocol.ShardRecord{Shard: 2, State: protocol.StateParked, Handoff: 8}, at(130))
	tr.written(protocol.ShardRecord{Shard: 2, Region: "a", State: protocol.StateBinding, Handoff: 8}, at(131))
	tr.written(protocol.ShardRecord{Shard: 2, Region: "a", State: protocol.StateActive, Order: 8}, at(140))

	wantMoves := []Move{
		{Shard: 0, Handoff: 5, From: "a", To: "b", Began: at(0), Paused: at(30), Bound: at(30), Ended: at(45), Done: true},
		{Shard: 1, Handoff: 6, To: "b", Began: at(50), Bound: at(51), Ended: at(60), Done: true},
		{Shard: 2, Handoff: 7, From: "b", Began: at(100), Ended: at(130)},
		{Shard: 2, Handoff: 8, To: "a", Began: at(130), Bound: at(131), Ended: at(140), Done: true},
	}
	if !slices.Equal(moves, wantMoves) {
		t.Fatalf("moves\n%+v\nwant\n%+v", moves, wantMoves)
	}
	want = map[protocol.ShardState]int64{protocol.StateActive: 3, protocol.StateUnowned: 0, protocol.StateParked: 0, protocol.StateHandoff: 0, protocol.StateBinding: 0}
	if got := st.Shards(); !mapsEqual(got, want) {
		t.Fatalf("shards by state %v, want %v", got, want)
	}
	tr.stop()
	if got := st.Shards()[protocol.StateActive]; got != 0 {
		t.Fatalf("after the term: active %d, want 0", got)
	}
}

func mapsEqual(a, b map[protocol.ShardState]int64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
