package coordinator

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/natshard/natshard/protocol"
)

// Scenarios of docs/PROTOCOL.md's Resharding; the sim checks after every
// action that no entity is live in two regions (checkFamilies: a region
// that has not split serves the children of its shards).

// splitScenario starts three regions on shards shards, settled, with
// rebalancing off.
func splitScenario(t *testing.T, shards int) (*sim, CoreConfig) {
	t.Helper()
	cfg := testConfig(shards)
	cfg.MinRegions = 3
	cfg.RebalanceEvery = -1
	s := newSim(t, cfg)
	for _, r := range []string{"a", "b", "c"} {
		s.join(r)
	}
	s.settled()
	return s, cfg
}

// checkSplit asserts that the split to n is announced, every shard is
// active, and every child is on its parent's region as before (before: the
// table before the split).
func checkSplit(t *testing.T, s *sim, before []protocol.ShardRecord, n int) {
	t.Helper()
	from := len(before)
	if s.config.Shards != n || s.config.To != 0 || !slices.Contains(s.config.History, from) {
		t.Fatalf("configuration %+v, want %d shards announced after %d", s.config, n, from)
	}
	s.settled()
	table := s.c.Table()
	if len(table) != n {
		t.Fatalf("%d rows, want %d", len(table), n)
	}
	for _, rec := range table {
		if p := before[rec.Shard%from]; rec.Region != p.Region || rec.Incarnation != p.Incarnation {
			t.Fatalf("shard %d on %s, its parent %d was on %s", rec.Shard, rec.Region, p.Shard, p.Region)
		}
	}
	for id, r := range s.regions {
		if !r.dead && r.count != n {
			t.Fatalf("region %s routes by %d shards, want %d", id, r.count, n)
		}
	}
}

func TestSplitStepByStep(t *testing.T) {
	s, _ := splitScenario(t, 8)
	before := s.c.Table()
	acts, note, err := s.c.Reshard(16)
	if err != nil {
		t.Fatal(err)
	}
	t.Log(note)
	// The commit first: the configuration with the split's target, then
	// the children's rows, copies of their parents', then the commands.
	w, ok := acts[0].(WriteConfig)
	if !ok || w.Config.To != 16 || w.Config.Shards != 8 {
		t.Fatalf("first action %#v, want the commit", acts[0])
	}
	for i, sh := 1, 8; sh < 16; i, sh = i+1, sh+1 {
		ws, ok := acts[i].(WriteShard)
		if !ok || ws.Record.Shard != sh || ws.Record.Region != before[sh-8].Region || ws.Record.State != protocol.StateActive {
			t.Fatalf("action %d %#v, want the row of shard %d on %s", i, acts[i], sh, before[sh-8].Region)
		}
	}
	var asked []string
	for _, a := range acts[9:] {
		if snd, ok := a.(Send); ok && snd.Command.Kind == protocol.CmdSplit && snd.Command.Count == 16 {
			asked = append(asked, snd.Region)
		}
	}
	if !slices.Equal(asked, []string{"a", "b", "c"}) {
		t.Fatalf("split commands to %v", asked)
	}
	s.run(acts)
	checkSplit(t, s, before, 16)
	// And again, to 64 at once.
	before = s.c.Table()
	acts, _, err = s.c.Reshard(64)
	if err != nil {
		t.Fatal(err)
	}
	s.run(acts)
	checkSplit(t, s, before, 64)
	if !slices.Equal(s.config.History, []int{8, 16}) {
		t.Fatalf("history %v", s.config.History)
	}
}

func TestSplitRefused(t *testing.T) {
	s, _ := splitScenario(t, 8)
	if acts, note, err := s.c.Reshard(8); err != nil || len(acts) != 0 {
		t.Fatalf("Reshard to the count the type has: %v, %v (%s)", acts, err, note)
	}
	for _, n := range []int{4, 12, 1 << 20} {
		if _, _, err := s.c.Reshard(n); !errors.Is(err, ErrBadRequest) {
			t.Errorf("Reshard(%d): %v, want ErrBadRequest", n, err)
		}
	}
	// A moving shard: asked again later.
	sh := slices.IndexFunc(s.c.Table(), func(r protocol.ShardRecord) bool { return r.Region == "a" })
	s.intercept = func(send Send) (CommandDone, bool) {
		return CommandDone{Send: send, Outcome: Failed}, send.Command.Kind == protocol.CmdHandOff
	}
	acts, _ := s.c.Move(sh, "b")
	s.run(acts)
	if _, _, err := s.c.Reshard(16); !errors.Is(err, ErrSplitBusy) {
		t.Fatalf("Reshard during a move: %v, want ErrSplitBusy", err)
	}
	s.intercept = nil
	s.ticks(20)
	s.settled()
	// A leaving region.
	s.leave("c")
	if _, _, err := s.c.Reshard(16); !errors.Is(err, ErrSplitBusy) {
		t.Fatalf("Reshard while c leaves: %v, want ErrSplitBusy", err)
	}
	if s.config.Shards != 0 {
		t.Fatalf("a refused split wrote %+v", s.config)
	}
	// Durable delivery splits as core delivery does (the regions forward
	// a parent's messages to its children: region.splitDurable).
	cfg := testConfig(8)
	cfg.TypeConfig = protocol.TypeConfig{Shards: 8, Delivery: protocol.DeliveryDurable}
	d := newSim(t, cfg)
	d.join("a")
	d.ticks(20)
	if acts, _, err := d.c.Reshard(16); err != nil || len(acts) == 0 {
		t.Fatalf("Reshard of a durable type: %d actions, %v", len(acts), err)
	}
}

// TestSplitWaitsForRegions: the announce waits for every region; meanwhile
// no move starts, a region that joins is asked too, and the shards of one
// that dies (children included) go only to regions that split.
func TestSplitWaitsForRegions(t *testing.T) {
	s, cfg := splitScenario(t, 8)
	before := s.c.Table()
	// b is still replaying one of its shards (its last move's buffer).
	var bShard int
	for _, rec := range before {
		if rec.Region == "b" {
			bShard = rec.Shard
			break
		}
	}
	s.regions["b"].modes[bShard] = "hold"
	acts, _, err := s.c.Reshard(16)
	if err != nil {
		t.Fatal(err)
	}
	s.run(acts)
	if s.config.To != 16 || s.c.Splitting() != 16 {
		t.Fatalf("config %+v: the split should wait for b", s.config)
	}
	if _, err := s.c.Move(before[0].Shard, "c"); !errors.Is(err, ErrShardBusy) {
		t.Fatalf("Move during a split: %v", err)
	}
	if ans, _ := s.c.Rebalance(false); len(ans.Moves) != 0 {
		t.Fatalf("a round during a split: %+v", ans)
	}
	s.join("d")
	if s.regions["d"].count != 16 {
		t.Fatalf("d started with %d shards", s.regions["d"].count)
	}
	// c dies: its shards and their children are parked, and bound to a or
	// d (which split), never to b.
	s.crash("c")
	s.ticks(cfg.ProbeEvery + 5)
	for _, rec := range s.c.Table() {
		if before[rec.Shard%8].Region == "c" && rec.Region == "b" {
			t.Fatalf("shard %d of the dead c went to b, which has not split", rec.Shard)
		}
	}
	if s.config.To != 16 {
		t.Fatalf("announced while b had not split: %+v", s.config)
	}
	s.regions["b"].modes[bShard] = "live" // its replay reached its marker
	s.ticks(cfg.Retry + 1)
	if s.config.Shards != 16 || s.config.To != 0 {
		t.Fatalf("not announced once b split: %+v", s.config)
	}
	s.settled()
}

// TestCoordinatorCrashMidSplit: the coordinator dies after any number of
// the actions of a split (its commit, the rows, the commands: a command
// it sent is carried out by its region, whose answer it never hears); the
// next one reads what was written and completes the split, or finds it
// never began. Never half-applied, and no entity live twice throughout.
func TestCoordinatorCrashMidSplit(t *testing.T) {
	probe, _ := splitScenario(t, 8)
	acts, _, _ := probe.c.Reshard(16)
	for cut := range len(acts) + 1 {
		t.Run(fmt.Sprint("after ", cut), func(t *testing.T) {
			s, cfg := splitScenario(t, 8)
			before := s.c.Table()
			s.config = protocol.TypeConfig{Shards: 8}
			acts, _, err := s.c.Reshard(16)
			if err != nil {
				t.Fatal(err)
			}
			s.runCut(acts, cut)
			s.takeOver(cfg, 2)
			s.ticks(cfg.Retry + 1)
			if cut == 0 {
				if s.config.Shards != 8 || s.config.To != 0 || len(s.c.Table()) != 8 {
					t.Fatalf("nothing was written, yet: config %+v, %d rows", s.config, len(s.c.Table()))
				}
				s.settled()
				return
			}
			checkSplit(t, s, before, 16)
		})
	}
}

// runCut carries out the first n actions of acts, and what the world does
// with them (a region obeys a command), but steps none of their outcomes
// into the core: its coordinator died.
func (s *sim) runCut(acts []Action, n int) {
	for _, a := range acts[:n] {
		switch a := a.(type) {
		case WriteShard:
			s.table[a.Record.Shard] = a.Record
		case WriteConfig:
			s.config = a.Config
		case Send:
			s.answer(a)
		case Park:
			if _, ok := s.parked[a.Shard]; ok || !a.Adopt {
				s.parked[a.Shard] = a.Handoff
			}
		}
	}
	s.check()
}

// takeOver makes a new coordinator of epoch take over from what was
// written: the table's rows and the configuration.
func (s *sim) takeOver(cfg CoreConfig, epoch uint64) {
	var regions []RegionSeen
	for _, id := range slices.Sorted(maps.Keys(s.regions)) {
		if r := s.regions[id]; r.rev != 0 || !r.dead {
			regions = append(regions, RegionSeen{Info: protocol.RegionInfo{ID: id, Incarnation: r.inc, Conn: r.conn}, Revision: r.rev})
		}
	}
	rows := make([]protocol.ShardRecord, 0, len(s.table))
	for _, sh := range slices.Sorted(maps.Keys(s.table)) {
		rows = append(rows, s.table[sh])
	}
	cfg.TypeConfig = s.config
	c, acts := NewCore(cfg, "coord", epoch, rows, regions)
	s.c = c
	s.run(acts)
}

// TestRandomHistoriesWithSplits is TestRandomHistories with splits, and
// coordinator changes that take over from what was written (the rows and
// the configuration), sometimes in the middle of a step.
func TestRandomHistoriesWithSplits(t *testing.T) {
	for seed := range uint64(100) {
		rng := rand.New(rand.NewPCG(seed, 11))
		cfg := testConfig(4)
		cfg.HandOffTimeout = 30
		s := newSim(t, cfg)
		s.config = protocol.TypeConfig{Shards: 4}
		next := 0
		epoch := uint64(1)
		splits := 0
		for range 80 {
			alive := []string{}
			for _, id := range slices.Sorted(maps.Keys(s.regions)) {
				if !s.regions[id].dead {
					alive = append(alive, id)
				}
			}
			switch op := rng.IntN(12); {
			case op < 3 || len(alive) == 0:
				next++
				s.join(fmt.Sprintf("r%d", next))
			case op == 3 && len(alive) > 1:
				s.crash(alive[rng.IntN(len(alive))])
			case op == 4 && len(alive) > 1 && rng.IntN(3) == 0:
				s.leave(alive[rng.IntN(len(alive))])
			case op == 5:
				sh, to := rng.IntN(len(s.c.table)), alive[rng.IntN(len(alive))]
				if acts, err := s.c.Move(sh, to); err == nil {
					s.run(acts)
				}
			case op == 6:
				epoch++
				s.takeOver(cfg, epoch)
			case op == 7 && len(s.c.table) < 64:
				acts, _, err := s.c.Reshard(len(s.c.table) * (2 + rng.IntN(2)))
				switch {
				case err == nil && rng.IntN(3) == 0:
					// The coordinator dies in the middle of it.
					s.runCut(acts, rng.IntN(len(acts)+1))
					epoch++
					s.takeOver(cfg, epoch)
					splits++
				case err == nil:
					s.run(acts)
					splits++
				case !errors.Is(err, ErrSplitBusy):
					t.Fatalf("seed %d: Reshard: %v", seed, err)
				}
			default:
				s.ticks(1 + rng.IntN(15))
			}
		}
		next++
		s.join(fmt.Sprintf("r%d", next))
		s.ticks(300)
		if s.config.To != 0 {
			t.Fatalf("seed %d: a split never announced: %+v", seed, s.config)
		}
		for _, rec := range s.c.Table() {
			r := s.regions[rec.Region]
			if rec.State != protocol.StateActive || r == nil || r.dead || r.modes[rec.Shard] != "live" {
				t.Fatalf("seed %d: shard %d not settled: %+v", seed, rec.Shard, rec)
			}
		}
		if seed == 0 {
			t.Logf("seed 0: %d splits, %d shards", splits, len(s.c.table))
		}
	}
}
