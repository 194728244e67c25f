package coordinator

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/natshard/natshard/protocol"
)

// sim is a world of regions that answer the core's commands the way
// region.Agent does, and checks docs/FAULTS.md's guarantees after every action:
// no shard is live in two regions, and no shard is diverted (by a region or
// the coordinator) while a region serves it live.
type sim struct {
	t       testing.TB
	c       *Core
	regions map[string]*simRegion
	table   map[int]protocol.ShardRecord // rows as written so far by WriteShard actions
	rev     uint64                       // the registrations' last revision
	removed []string                     // regions removed by RemoveRegion actions that succeeded
	parked  map[int]uint64               // shards the coordinator diverts, with handoff id
	markers map[int][]uint64             // end markers written per shard
	fences  map[int][]uint64             // handoffs fenced per shard (Park.Fence, Mark.Fence)
	pins    map[int]string               // pins as written by WritePin actions
	config  protocol.TypeConfig          // the configuration as written by WriteConfig actions (zero: never)
	// hooks let a scenario intercept a command before the region answers.
	intercept func(s Send) (CommandDone, bool)
	warnings  []string
	stepDowns int
	rounds    []RoundPlanned // rebalance rounds reported
	done      []RoundDone
	noRounds  []string // reasons reported for no round
	// unchecked skips the invariant checks (benchmarks measure the core,
	// not the checks); writes and sends count the table writes and the
	// commands the core asked for.
	unchecked     bool
	writes, sends int
}

type simRegion struct {
	id, inc string
	conn    protocol.ConnID // its NATS connection, as its registration names it
	rev     uint64          // its registration's revision; 0: removed
	dead    bool
	modes   map[int]string  // shard -> live, hold, divert
	holdFor map[int]uint64  // shard in hold -> marker it waits for
	rates   map[int]float64 // shard -> messages/s it reports in probe answers, when live
	count   int             // the shard count it routes by; it splits on the split command
}

func newSim(t testing.TB, cfg CoreConfig) *sim {
	return newSimAt(t, cfg, nil, nil, false)
}

// newSimAt starts the sim with a coordinator that takes over table with
// regions registered; unchecked as in sim.
func newSimAt(t testing.TB, cfg CoreConfig, table []protocol.ShardRecord, regions []*simRegion, unchecked bool) *sim {
	s := &sim{t: t, regions: map[string]*simRegion{}, table: map[int]protocol.ShardRecord{}, parked: map[int]uint64{}, markers: map[int][]uint64{}, fences: map[int][]uint64{}, pins: map[int]string{}, unchecked: unchecked}
	seen := make([]RegionSeen, len(regions))
	for i, r := range regions {
		s.regions[r.id] = r
		seen[i] = RegionSeen{Info: protocol.RegionInfo{ID: r.id, Incarnation: r.inc, Conn: r.conn}, Revision: 1}
	}
	for _, rec := range table {
		s.table[rec.Shard] = rec
	}
	c, acts := NewCore(cfg, "coord", 1, table, seen)
	s.c = c
	for _, r := range regions {
		if r.count == 0 {
			r.count = c.Layout().Shards()
		}
	}
	s.run(acts)
	return s
}

func newSimRegion(id string, n int) *simRegion {
	return &simRegion{id: id, inc: id + "-1", conn: protocol.ConnID{Server: "srv", Client: uint64(n)},
		modes: map[int]string{}, holdFor: map[int]uint64{}, rates: map[int]float64{}}
}

func (s *sim) join(id string) {
	r := newSimRegion(id, len(s.regions)+1)
	r.count = s.c.Layout().Shards() // what it reads at its start
	s.regions[id] = r
	s.renew(id, false)
}

// renew writes region id's registration again (a renewal, or the leaving
// mark).
func (s *sim) renew(id string, leaving bool) {
	r := s.regions[id]
	s.rev++
	r.rev = s.rev
	s.run(s.c.Step(RegionUp{RegionSeen{Info: protocol.RegionInfo{ID: id, Incarnation: r.inc, Conn: r.conn, Leaving: leaving}, Revision: r.rev}}))
}

func (s *sim) leave(id string) {
	s.renew(id, true)
}

// crash kills a region; the core finds out through a probe.
func (s *sim) crash(id string) { s.regions[id].dead = true }

// deregister: the region's registration is gone (expired or released).
func (s *sim) deregister(id string) {
	s.regions[id].dead, s.regions[id].rev = true, 0
	s.run(s.c.Step(RegionGone{ID: id}))
}

func (s *sim) ticks(n int) {
	for range n {
		s.run(s.c.Tick())
	}
}

// run carries out actions, and the actions that their outcomes cause,
// until none is left. The invariants are checked after every action for
// the shards it is about, and for all shards at the end.
func (s *sim) run(acts []Action) {
	for len(acts) > 0 {
		a := acts[0]
		acts = acts[1:]
		var ev Event
		var about []int
		switch a := a.(type) {
		case WriteShard:
			s.writes++
			s.table[a.Record.Shard] = a.Record
			about = []int{a.Record.Shard}
		case Send:
			s.sends++
			ev = s.answer(a)
			about = a.Command.Shards
		case Park:
			if a.Fence != 0 {
				s.fences[a.Shard] = append(s.fences[a.Shard], a.Fence)
			}
			if _, ok := s.parked[a.Shard]; ok || !a.Adopt {
				s.parked[a.Shard] = a.Handoff
			}
			about = []int{a.Shard}
		case Unpark:
			delete(s.parked, a.Shard)
			if a.Live {
				// The buffer is purged: right only if its owner was live.
				if o := s.regions[s.c.Table()[a.Shard].Region]; o == nil || o.modes[a.Shard] != "live" {
					s.t.Errorf("shard %d: buffer purged on unpark, but its owner is not live", a.Shard)
				}
			} else {
				s.mark(a.Shard, a.Handoff)
			}
			ev = Unparked{Shard: a.Shard, Handoff: a.Handoff}
			about = []int{a.Shard}
		case Mark:
			if a.Fence {
				s.fences[a.Shard] = append(s.fences[a.Shard], a.Handoff)
			}
			s.mark(a.Shard, a.Handoff)
			ev = Marked{Shard: a.Shard, Handoff: a.Handoff}
			about = []int{a.Shard}
		case RemoveRegion:
			// A compare-and-delete: the watch then reports the region gone.
			if r := s.regions[a.ID]; r != nil && r.rev != 0 && r.rev == a.Revision {
				r.rev = 0
				s.removed = append(s.removed, a.ID)
				ev = RegionGone{ID: a.ID}
			}
		case Warn:
			s.warnings = append(s.warnings, a.Msg)
		case StepDown:
			s.stepDowns++
		case RoundPlanned:
			s.rounds = append(s.rounds, a)
		case RoundDone:
			s.done = append(s.done, a)
		case NoRound:
			s.noRounds = append(s.noRounds, a.Reason)
		case WriteConfig:
			s.config = a.Config
		case WritePin:
			if a.Region == "" {
				delete(s.pins, a.Shard)
			} else {
				s.pins[a.Shard] = a.Region
			}
		}
		for _, sh := range about {
			if !s.unchecked {
				s.checkShard(sh)
			}
		}
		if ev != nil {
			acts = append(acts, s.c.Step(ev)...)
		}
	}
	if !s.unchecked {
		s.check()
	}
}

func (s *sim) mark(sh int, h uint64) {
	s.markers[sh] = append(s.markers[sh], h)
	for _, r := range s.regions {
		if r.modes[sh] == "hold" && r.holdFor[sh] == h {
			r.modes[sh] = "live"
		}
	}
}

func (s *sim) answer(send Send) Event {
	if s.intercept != nil {
		if done, ok := s.intercept(send); ok {
			return done
		}
	}
	r := s.regions[send.Region]
	if r == nil || r.dead {
		return CommandDone{Send: send, Outcome: NoResponders}
	}
	cmd := send.Command
	reply := protocol.Reply{Epoch: cmd.Epoch, Incarnation: r.inc}
	if cmd.Incarnation != r.inc {
		reply.Error = "other incarnation"
		return CommandDone{Send: send, Outcome: Refused, Reply: reply}
	}
	for _, sh := range cmd.Shards {
		if sh >= r.count {
			// As Command.Validate refuses it.
			reply.Error = fmt.Sprintf("shard %d out of range 0..%d", sh, r.count-1)
			return CommandDone{Send: send, Outcome: Refused, Reply: reply}
		}
	}
	if cmd.Kind == protocol.CmdSplit {
		s.split(r, cmd.Count, &reply)
	}
	complete := true
	for i, sh := range cmd.Shards {
		switch cmd.Kind {
		case protocol.CmdBind:
			if r.modes[sh] == "live" {
				reply.Live = append(reply.Live, sh)
			}
			if r.modes[sh] == "" {
				r.modes[sh], r.holdFor[sh] = "hold", cmd.Handoffs[i]
				if slices.Contains(s.markers[sh], cmd.Handoffs[i]) {
					r.modes[sh] = "live"
				}
			}
		case protocol.CmdHandOff:
			switch r.modes[sh] {
			case "live":
				r.modes[sh] = "divert"
			case "hold":
				complete = false
				reply.Replaying = append(reply.Replaying, sh)
			}
		case protocol.CmdRelease:
			if r.modes[sh] == "divert" {
				delete(r.modes, sh)
			}
			s.mark(sh, cmd.Handoffs[i])
		case protocol.CmdDrop:
			delete(r.modes, sh)
		}
	}
	reply.Complete = complete
	// The core reads Held only in probe answers; unchecked (benchmarks)
	// builds it only there, or the sim's sorting would be timed as the
	// core's work.
	if cmd.Kind == protocol.CmdProbe || !s.unchecked {
		for sh := range r.modes {
			reply.Held = append(reply.Held, sh)
		}
		slices.Sort(reply.Held)
	}
	if cmd.Kind == protocol.CmdProbe {
		for _, sh := range reply.Held {
			if rate, ok := r.rates[sh]; ok && r.modes[sh] == "live" {
				reply.Load = append(reply.Load, protocol.ShardLoad{Shard: sh, Rate: rate, Entities: 1})
			}
		}
	}
	return CommandDone{Send: send, Outcome: OK, Reply: reply}
}

// split is a region's answer to the split command (region.Core): once
// every shard it holds is live, each gives its children to the region.
func (s *sim) split(r *simRegion, to int, reply *protocol.Reply) {
	if r.count == to {
		return
	}
	if l, err := s.config.Layout(); s.config.Shards != 0 && (err != nil || !l.Has(to)) {
		s.t.Fatalf("region %s told to split to %d, the stored configuration %+v does not say so", r.id, to, s.config)
	}
	for _, sh := range slices.Sorted(maps.Keys(r.modes)) {
		if r.modes[sh] != "live" {
			reply.Replaying = append(reply.Replaying, sh)
		}
	}
	if len(reply.Replaying) > 0 {
		return
	}
	for sh := range maps.Clone(r.modes) {
		for c := sh + r.count; c < to; c += r.count {
			r.modes[c] = "live"
		}
	}
	r.count = to
}

// check asserts the invariants of the world as it is now.
func (s *sim) check() {
	s.t.Helper()
	for sh := range len(s.c.table) {
		s.checkShard(sh)
	}
	s.checkFamilies()
	s.checkIndexes()
}

// checkFamilies asserts the single owner invariant across counts: a
// region that routes by fewer shards than the table (it has not split)
// serves every child of the shards it holds, so no two live regions may
// hold shards whose entities overlap, nor may one serve what another (or
// the coordinator) diverts.
func (s *sim) checkFamilies() {
	s.t.Helper()
	n := len(s.c.table)
	live := make([]string, n)
	divert := make([][]string, n)
	for _, id := range slices.Sorted(maps.Keys(s.regions)) {
		r := s.regions[id]
		if r.dead {
			continue
		}
		for sh, mode := range r.modes {
			if r.count > n || sh >= r.count {
				s.t.Fatalf("region %s routes by %d shards and holds shard %d; the table has %d", id, r.count, sh, n)
			}
			for f := sh; f < n; f += r.count {
				switch mode {
				case "live":
					if live[f] != "" {
						s.t.Fatalf("the entities of shard %d of %d are live in %s and %s", f, n, live[f], id)
					}
					live[f] = id
				case "divert":
					divert[f] = append(divert[f], id)
				}
			}
		}
	}
	for sh := range s.parked {
		divert[sh] = append(divert[sh], "coordinator")
	}
	for f := range n {
		if live[f] != "" && len(divert[f]) > 0 {
			s.t.Fatalf("the entities of shard %d of %d are live in %s while %v divert them", f, n, live[f], divert[f])
		}
	}
}

// checkIndexes asserts that the core's counts and per-region rows are
// those of its table.
func (s *sim) checkIndexes() {
	s.t.Helper()
	moving, parked, rows := 0, 0, map[string]map[int]bool{}
	for sh, rec := range s.c.table {
		if isMove(rec) {
			moving++
		}
		if rec.State == protocol.StateParked {
			parked++
		}
		if rec.Region != "" {
			if rows[rec.Region] == nil {
				rows[rec.Region] = map[int]bool{}
			}
			rows[rec.Region][sh] = true
		}
	}
	if moving != s.c.moving || parked != s.c.parked || !maps.EqualFunc(rows, s.c.rows, maps.Equal) {
		s.t.Fatalf("core's indexes differ from its table: moving %d (table %d), parked %d (table %d), rows %v (table %v)", s.c.moving, moving, s.c.parked, parked, s.c.rows, rows)
	}
}

// checkShard asserts the invariants for shard sh.
func (s *sim) checkShard(sh int) {
	s.t.Helper()
	if sh < 0 || sh >= len(s.c.table) {
		return
	}
	var live, divert []string
	for _, id := range slices.Sorted(maps.Keys(s.regions)) {
		r := s.regions[id]
		if r.dead {
			continue
		}
		switch r.modes[sh] {
		case "live":
			live = append(live, id)
		case "divert":
			divert = append(divert, id)
		}
	}
	if _, ok := s.parked[sh]; ok {
		divert = append(divert, "coordinator")
	}
	if len(live) > 1 {
		s.t.Fatalf("shard %d is live in %v", sh, live)
	}
	if len(live) == 1 && len(divert) > 0 {
		s.t.Fatalf("shard %d is live in %s while %v divert it", sh, live[0], divert)
	}
	// A shard the table records as parked is caught by the coordinator.
	if rec := s.table[sh]; rec.State == protocol.StateParked && s.parked[sh] == 0 {
		s.t.Fatalf("shard %d is parked in the table but nobody diverts it", sh)
	}
}

// settled asserts that every shard is active on a live region that serves
// it, and that nobody diverts.
func (s *sim) settled() {
	s.t.Helper()
	for _, rec := range s.c.Table() {
		r := s.regions[rec.Region]
		if rec.State != protocol.StateActive || r == nil || r.dead || r.modes[rec.Shard] != "live" {
			s.t.Fatalf("shard %d not settled: %+v (region modes %v)", rec.Shard, rec, r)
		}
	}
	if len(s.parked) > 0 {
		s.t.Fatalf("still parked: %v", s.parked)
	}
}

func (s *sim) counts() map[string]int {
	m := map[string]int{}
	for _, rec := range s.c.Table() {
		m[rec.Region]++
	}
	return m
}

func (s *sim) owner(sh int) string { return s.c.Table()[sh].Region }

func spread(m map[string]int) int {
	lo, hi := 1<<30, 0
	for _, n := range m {
		lo, hi = min(lo, n), max(hi, n)
	}
	return hi - lo
}
