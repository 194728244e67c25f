package coordinator

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// This file holds the life of a shard in the table: parked, allocated
// (bound to a target the strategy or an operator chose), moved, active,
// taken over when a handoff times out; and the strategy's view of the
// regions.

// park makes the coordinator the holder of shard sh under a new handoff id:
// it starts diverting first, then records it.
func (c *Core) park(sh int) { c.parkFenced(sh, 0) }

// parkFenced is park, fencing handoff id fence first (0: none; see Park).
func (c *Core) parkFenced(sh int, fence uint64) {
	c.order++
	rec := c.table[sh]
	c.out = append(c.out, Park{Shard: sh, Handoff: c.order, Fence: fence})
	c.write(protocol.ShardRecord{Shard: sh, State: protocol.StateParked, Order: rec.Order, Epoch: c.epoch, Handoff: c.order})
	c.steps[sh] = step{at: c.tick}
}

// allocate binds every parked shard to a region chosen by the strategy.
// The first allocation waits for MinRegions; later ones never do.
func (c *Core) allocate() {
	c.started = c.started || len(c.regions) >= max(c.cfg.MinRegions, 1)
	if !c.started || c.parked == 0 {
		return
	}
	var binds map[string][]int
	view := c.strategyView("") // kept up to date as shards are placed
	for sh, rec := range c.table {
		if rec.State != protocol.StateParked {
			continue
		}
		target, ok := c.pickTargetIn(sh, "", view)
		if !ok {
			return // no region can take shards now
		}
		c.bindTo(sh, target, "", "")
		c.placeInView(view, sh)
		if binds == nil {
			binds = map[string][]int{}
		}
		binds[target] = append(binds[target], sh)
	}
	for _, id := range slices.Sorted(maps.Keys(binds)) {
		c.sendBindBatch(id, binds[id])
	}
}

// startMove begins the handoff of an active shard from its owner.
func (c *Core) startMove(sh int) {
	c.order++
	rec := c.table[sh]
	rec.State = protocol.StateHandoff
	rec.Source, rec.SourceIncarnation = rec.Region, rec.Incarnation
	rec.Handoff = c.order
	rec.Epoch = c.epoch
	c.write(rec)
	c.steps[sh] = step{at: c.tick}
	c.stats.HandOffsStarted.Add(1)
	c.sendHandOff(sh)
}

// chooseTarget continues a paused shard's move: bind it to a target other
// than exclude (its source), or, with none available, take it over (park)
// and release the source.
func (c *Core) chooseTarget(sh int, exclude string) {
	rec := c.table[sh]
	target, ok := c.pickTargetIn(sh, exclude, nil)
	if !ok {
		src := c.regions[rec.Source]
		h := rec.Handoff
		c.park(sh)
		if src != nil {
			c.send(src, protocol.CmdRelease, []int{sh}, []uint64{h})
		}
		return
	}
	c.bindTo(sh, target, rec.Source, rec.SourceIncarnation)
	c.sendBind(sh)
}

// retarget gives a binding shard whose target died another target.
func (c *Core) retarget(sh int) {
	rec := c.table[sh]
	target, ok := c.pickTargetIn(sh, rec.Source, nil)
	if !ok {
		if rec.Source == "" {
			c.park(sh)
		} else if src := c.regions[rec.Source]; src != nil {
			h := rec.Handoff
			c.park(sh)
			c.send(src, protocol.CmdRelease, []int{sh}, []uint64{h})
		} else {
			c.park(sh)
		}
		return
	}
	c.bindTo(sh, target, rec.Source, rec.SourceIncarnation)
	c.sendBind(sh)
}

// bindTo records shard sh binding to target; the caller sends the Bind.
func (c *Core) bindTo(sh int, target, source, sourceInc string) {
	rec := c.table[sh]
	r := c.regions[target]
	rec.State = protocol.StateBinding
	rec.Region, rec.Incarnation = target, r.Info.Incarnation
	rec.Source, rec.SourceIncarnation = source, sourceInc
	rec.Epoch = c.epoch
	c.write(rec)
	want := c.steps[sh].want
	c.steps[sh] = step{at: c.tick, sentAt: c.tick, want: want}
}

func (c *Core) activate(sh int) {
	rec := c.table[sh]
	c.write(protocol.ShardRecord{
		Shard: sh, Region: rec.Region, Incarnation: rec.Incarnation,
		State: protocol.StateActive, Order: rec.Handoff, Epoch: c.epoch,
	})
	c.steps[sh] = step{at: c.tick}
}

// handOffTimedOut: the source did not pause in time. The coordinator takes
// the shard over (parks it under the same id: the source writes no marker
// for it), tells the source to drop it, and continues the move. This is the
// documented forced reallocation: the source's stuck entities may still run.
// The park fences the handoff first: a source that was frozen, and wakes
// up to pause the shard after all, appends behind the coordinator's
// messages, and no replay must take those appends (issue 30, A).
func (c *Core) handOffTimedOut(sh int) {
	rec := c.table[sh]
	source := rec.Source
	c.stats.HandOffsTimedOut.Add(1)
	c.out = append(c.out, Warn{Msg: fmt.Sprintf("handoff of shard %d from region %s timed out; dropping it there and reallocating", sh, source)})
	c.out = append(c.out, Park{Shard: sh, Handoff: rec.Handoff, Fence: rec.Handoff})
	if src, ok := c.regions[source]; ok {
		c.send(src, protocol.CmdDrop, []int{sh}, nil)
	}
	rec.Source, rec.SourceIncarnation = "", ""
	c.setRow(rec)
	c.chooseTarget(sh, source)
}

// pickTargetIn chooses where shard sh goes: the operator's wish if it can
// take it, else the strategy's choice among the regions other than
// exclude, in view (the strategy's view, which must leave out exclude;
// nil: built here).
func (c *Core) pickTargetIn(sh int, exclude string, view []strategies.Region) (string, bool) {
	if want := c.steps[sh].want; want != "" && want != exclude && c.hasSplit(want) {
		if r, ok := c.regions[want]; ok && !r.Info.Leaving {
			return want, true
		}
	}
	if view == nil {
		view = c.strategyView(exclude)
	}
	if len(view) == 0 {
		return "", false
	}
	id, err := c.strategy.Allocate(sh, "", view)
	if r, ok := c.regions[id]; err != nil || !ok || r.Info.Leaving || id == exclude {
		return "", false
	}
	return id, true
}

// strategyView is the regions as the strategy sees them, except exclude:
// each with the shards it holds (active, binding to it, or pausing on it
// for a handoff), oldest allocation first. A pausing shard counts where
// it is until it binds elsewhere, so that placing one move's shard does
// not see its source emptier than it is because of the others in flight.
func (c *Core) strategyView(exclude string) []strategies.Region {
	at := make(map[string]int, len(c.regions))
	view := make([]strategies.Region, 0, len(c.regions))
	for _, id := range c.sortedRegionIDs() {
		if id == exclude || !c.hasSplit(id) {
			continue // during a split, only regions that split take shards
		}
		r := c.regions[id]
		at[id] = len(view)
		view = append(view, strategies.Region{ID: id, Version: r.Info.Version, Leaving: r.Info.Leaving})
	}
	// One walk of the table for all regions (regions x shards was the
	// cost of a first allocation: docs/bench-log/scaling.md).
	held := make([][]protocol.ShardRecord, len(view))
	for _, rec := range c.table {
		i, ok := at[rec.Region]
		if ok && holds(rec) && rec.Incarnation == c.regions[rec.Region].Info.Incarnation {
			held[i] = append(held[i], rec)
		}
	}
	for i := range view {
		slices.SortFunc(held[i], func(a, b protocol.ShardRecord) int {
			return cmp.Or(cmp.Compare(a.Order, b.Order), cmp.Compare(a.Shard, b.Shard))
		})
		shards := make([]int, len(held[i]))
		var load []strategies.ShardLoad
		known := true
		for j, h := range held[i] {
			shards[j] = h.Shard
			// Load is positional: it stops at the first shard whose load
			// is not known yet, and the strategy estimates the rest.
			l, ok := c.load[h.Shard]
			if known = known && ok; known {
				load = append(load, l)
			}
		}
		view[i].Shards, view[i].Load = shards, load
	}
	return view
}

// holds says whether a row counts as its region's in the strategy's view:
// active, binding to it, or pausing on it for a handoff.
func holds(rec protocol.ShardRecord) bool {
	return rec.State == protocol.StateActive || rec.State == protocol.StateBinding || rec.State == protocol.StateHandoff
}

// placeInView adds shard sh, just bound, to its region in view, where
// strategyView would put it now (oldest allocation first, its load where
// the known prefix reaches it), so that one view serves a whole
// allocation instead of one walk of the table per shard.
func (c *Core) placeInView(view []strategies.Region, sh int) {
	rec := c.table[sh]
	i, ok := slices.BinarySearchFunc(view, rec.Region, func(r strategies.Region, id string) int { return strings.Compare(r.ID, id) })
	if !ok {
		return
	}
	r := &view[i]
	pos, _ := slices.BinarySearchFunc(r.Shards, rec, func(s int, rec protocol.ShardRecord) int {
		return cmp.Or(cmp.Compare(c.table[s].Order, rec.Order), cmp.Compare(s, rec.Shard))
	})
	r.Shards = slices.Insert(r.Shards, pos, sh)
	if pos <= len(r.Load) {
		if l, known := c.load[sh]; known {
			r.Load = slices.Insert(r.Load, pos, l)
		} else {
			r.Load = r.Load[:pos]
		}
	}
}
