package coordinator

import (
	"fmt"
	"maps"
	"slices"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// This file holds the rebalance rounds and the moves off leaving regions.
//
// A round asks the strategy once which shards to move and keeps the
// answer as a plan: its moves start as moves in flight end (at most
// MaxMoves at once), not one batch per interval, so a round takes as long
// as its handoffs, which are cheap. Akka's gates stay: one plan at a time,
// no round while membership changes (Settle) and, in the strategies, none
// while versions are mixed; load-aware keeps its hysteresis.
//
// A round that moved shards is followed, once its moves have ended, by
// another at once: the strategy may have more to do (least-shard's phase
// 2, a strategy's limit per round). After a round that moves nothing, or
// after 1+maxFollowUps rounds in a row that moved shards, the next waits
// for RebalanceEvery: a strategy that never settles moves shards at that
// pace, not at handoff speed.

// maxFollowUps bounds the rounds in a row that run without waiting for
// RebalanceEvery. The built-in strategies need one (least-shard balances
// within two rounds).
const maxFollowUps = 3

// roundState is the current rebalance round.
type roundState struct {
	n       int           // rounds planned in this term; the current one's number
	plan    []plannedMove // moves of the round not started yet, in the strategy's order
	open    bool          // the round has moves not started or not ended
	started int           // moves the round started
	dropped int           // planned moves it did not start
	why     string        // why it dropped moves
	note    string        // the last reason reported for no round (NoRound)
	flux    bool          // membership changed since the last round
	follow  bool          // the last round moved shards: the next is due at once
	chained int           // rounds in a row that moved shards, since membership changed
}

// plannedMove is a move of a round: the shard, its owner when planned, and
// where the plan places it.
type plannedMove struct {
	shard   int
	from    string
	fromInc string
	to      string // "": the strategy chooses when the shard has paused
}

// rebalance runs a strategy round when it is due (RebalanceEvery after
// the last one, after a change of membership since, or as the follow-up of
// a round that moved shards) and Akka's gates allow: one plan at a time
// (the previous round's moves have all ended), membership unchanged for
// Settle ticks.
func (c *Core) rebalance() {
	r := &c.rounds
	due := c.tick-c.lastRound >= c.cfg.RebalanceEvery || r.flux || r.follow
	if c.cfg.RebalanceEvery < 0 || r.open || !due {
		return
	}
	if c.split != nil {
		c.noRound(fmt.Sprintf("the type splits to %d shards", c.split.to), false)
		return
	}
	if c.tick-c.lastFlux < c.cfg.Settle {
		c.noRound("membership changed: waiting for it to settle", true)
		return
	}
	c.lastRound, r.flux, r.follow = c.tick, false, false
	moves, busy := c.round()
	c.startRound(c.plan(moves), busy)
}

// round asks the strategy which shards to move now, and returns those that
// are active (without duplicates), and how many shards are in progress
// (not active, or on a leaving region), which the strategy was told. While
// a round is open it returns no moves: one plan at a time.
func (c *Core) round() (moves []int, inProgress int) {
	var busy []int
	for sh, rec := range c.table {
		if rec.State != protocol.StateActive {
			busy = append(busy, sh)
		} else if r := c.regions[rec.Region]; r != nil && r.Info.Leaving {
			busy = append(busy, sh)
		}
	}
	if len(c.regions) < 2 || c.rounds.open || c.split != nil {
		return nil, len(busy)
	}
	planned, err := c.strategy.Rebalance(c.strategyView(""), busy)
	if err != nil {
		return nil, len(busy)
	}
	seen := map[int]bool{}
	for _, sh := range planned {
		if sh >= 0 && sh < len(c.table) && c.table[sh].State == protocol.StateActive && !seen[sh] {
			seen[sh] = true
			moves = append(moves, sh)
		}
	}
	return moves, len(busy)
}

// startRound makes moves the plan of a new round and starts the first of
// them; with no moves it reports why no round runs.
func (c *Core) startRound(moves []protocol.PlannedMove, busy int) {
	if len(moves) == 0 {
		c.rounds.chained = 0
		c.noRound(c.whyNoMoves(busy), false)
		return
	}
	counts := map[string]int{}
	for _, r := range c.strategyView("") {
		counts[r.ID] = len(r.Shards)
	}
	c.stats.round(len(moves))
	r := &c.rounds
	r.n++
	r.plan = r.plan[:0]
	for _, m := range moves {
		r.plan = append(r.plan, plannedMove{shard: m.Shard, from: m.From, fromInc: c.table[m.Shard].Incarnation, to: m.To})
	}
	r.open, r.started, r.dropped, r.why, r.note = true, 0, 0, "", ""
	c.out = append(c.out, RoundPlanned{Round: r.n, Moves: moves, Regions: counts})
	c.continuePlan()
}

// continuePlan starts the round's next moves within the bound on moves in
// flight, skipping those whose shard changed since the round planned it,
// and reports the round done once all its moves have ended.
func (c *Core) continuePlan() {
	r := &c.rounds
	if !r.open {
		return
	}
	for len(r.plan) > 0 && c.moving < c.cfg.MaxMoves {
		m := r.plan[0]
		r.plan = r.plan[1:]
		rec := c.table[m.shard]
		if rec.State != protocol.StateActive || rec.Region != m.from || rec.Incarnation != m.fromInc {
			r.dropped++
			r.why = "shards changed since the round planned them"
			continue
		}
		c.startMove(m.shard)
		c.steps[m.shard].want = m.to
		r.started++
	}
	if len(r.plan) == 0 && c.moving == 0 {
		r.open = false
		if r.started > 0 {
			r.chained++
		}
		r.follow = r.started > 0 && r.chained <= maxFollowUps
		c.out = append(c.out, RoundDone{Round: r.n, Moved: r.started, Dropped: r.dropped, Reason: r.why})
	}
}

// flux records a change of membership: rounds wait for it to settle, and
// the current round starts no more moves (what it planned was for other
// regions).
func (c *Core) flux() {
	c.lastFlux, c.rounds.flux, c.rounds.chained = c.tick, true, 0
	c.dropPlan("membership changed")
}

// dropPlan forgets the moves the current round has not started.
func (c *Core) dropPlan(why string) {
	r := &c.rounds
	if len(r.plan) == 0 {
		return
	}
	r.dropped += len(r.plan)
	r.plan = r.plan[:0]
	r.why = why
}

// noRound reports why no round runs, when the reason changed since it was
// last reported; settling says it is the wait for membership to settle.
func (c *Core) noRound(why string, settling bool) {
	if c.rounds.note == why {
		return
	}
	c.rounds.note = why
	c.out = append(c.out, NoRound{Reason: why, Settling: settling})
}

// whyNoMoves says why a round found nothing to move.
func (c *Core) whyNoMoves(busy int) string {
	versions := map[string]bool{}
	takers := 0
	for _, r := range c.regions {
		if !r.Info.Leaving {
			takers++
			versions[r.Info.Version] = true
		}
	}
	switch {
	case takers < 2:
		return "fewer than two regions take shards"
	case busy > 0:
		return fmt.Sprintf("%d shards are moving, parked or on a leaving region", busy)
	case len(versions) > 1:
		return fmt.Sprintf("the regions run different versions %v (a rolling update)", slices.Sorted(maps.Keys(versions)))
	}
	return "the strategy moves nothing: balanced"
}

// moveOffLeaving starts moves of the shards of leaving regions, within the
// bound on moves in flight.
func (c *Core) moveOffLeaving() {
	if c.split != nil {
		return // after the announce
	}
	for _, id := range c.sortedRegionIDs() {
		r := c.regions[id]
		if !r.Info.Leaving {
			continue
		}
		for _, sh := range c.rowsOf(id) {
			if c.moving >= c.cfg.MaxMoves {
				return
			}
			if rec := c.table[sh]; rec.State == protocol.StateActive && rec.Incarnation == r.Info.Incarnation {
				c.startMove(sh)
			}
		}
	}
}

// plan predicts where moves go: all of them leave their regions first,
// then each is placed through the strategy in order, as the coordinator
// does when their handoffs complete (without offering a shard its own
// source region).
func (c *Core) plan(moves []int) []protocol.PlannedMove {
	view := c.strategyView("")
	moving := map[int]bool{}
	for _, sh := range moves {
		moving[sh] = true
	}
	for i := range view {
		r := &view[i]
		var shards []int
		var load []strategies.ShardLoad
		for j, sh := range r.Shards {
			if moving[sh] {
				continue
			}
			shards = append(shards, sh)
			if j < len(r.Load) {
				load = append(load, r.Load[j])
			}
		}
		r.Shards, r.Load = shards, load
	}
	out := make([]protocol.PlannedMove, len(moves))
	for k, sh := range moves {
		from := c.table[sh].Region
		offer := slices.DeleteFunc(slices.Clone(view), func(r strategies.Region) bool { return r.ID == from })
		to, err := c.strategy.Allocate(sh, "", offer)
		i := slices.IndexFunc(view, func(r strategies.Region) bool { return r.ID == to })
		if err != nil || i < 0 || view[i].Leaving {
			to = ""
		} else {
			r := &view[i]
			if l, ok := c.load[sh]; ok && len(r.Load) == len(r.Shards) {
				r.Load = append(slices.Clone(r.Load), l)
			}
			r.Shards = append(slices.Clone(r.Shards), sh)
		}
		out[k] = protocol.PlannedMove{Shard: sh, From: from, To: to}
	}
	return out
}
