package coordinator

import (
	"cmp"
	"maps"
	"slices"
	"strings"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

func (c *Core) write(rec protocol.ShardRecord) {
	c.setRow(rec)
	c.out = append(c.out, WriteShard{Record: rec})
}

// setRow changes a row of the table, keeping count of the moves in flight
// and the parked rows, and the shards of each region.
func (c *Core) setRow(rec protocol.ShardRecord) {
	old := c.table[rec.Shard]
	if isMove(old) {
		c.moving--
	}
	if isMove(rec) {
		c.moving++
	}
	if old.State == protocol.StateParked {
		c.parked--
	}
	if rec.State == protocol.StateParked {
		c.parked++
	}
	if old.Region != rec.Region {
		if m := c.rows[old.Region]; m != nil {
			delete(m, rec.Shard)
			if len(m) == 0 {
				delete(c.rows, old.Region)
			}
		}
		if rec.Region != "" {
			if c.rows[rec.Region] == nil {
				c.rows[rec.Region] = map[int]bool{}
			}
			c.rows[rec.Region][rec.Shard] = true
		}
	}
	c.table[rec.Shard] = rec
}

// rowsOf is the shards whose row names region id, in shard order: a walk of
// the region's rows instead of the whole table.
func (c *Core) rowsOf(id string) []int {
	return slices.Sorted(maps.Keys(c.rows[id]))
}

// isMove says whether a row is a move of a live shard: a handoff, or a
// bind whose source is a region.
func isMove(rec protocol.ShardRecord) bool {
	return rec.State == protocol.StateHandoff || rec.State == protocol.StateBinding && rec.Source != ""
}

// live reports whether region id with incarnation inc is registered.
func (c *Core) live(id, inc string) bool {
	r, ok := c.regions[id]
	return ok && id != "" && r.Info.Incarnation == inc
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
		if id == exclude {
			continue
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

// regionsChanged sorts the region IDs again after a region came or went.
func (c *Core) regionsChanged() { c.ids = slices.Sorted(maps.Keys(c.regions)) }

// sortedRegionIDs is the IDs of the live regions, sorted. The slice is
// replaced, never changed, when a region comes or goes, so a loop over it
// may add or remove regions; callers must not modify it.
func (c *Core) sortedRegionIDs() []string { return c.ids }

func (c *Core) flush() []Action {
	out := c.out
	c.out = nil
	return out
}
