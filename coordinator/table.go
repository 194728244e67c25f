package coordinator

import (
	"maps"
	"slices"

	"github.com/natshard/natshard/protocol"
)

// This file holds the core's outbox and table bookkeeping: the commands
// it sends, the rows it writes (with the counts kept beside the table)
// and the sorted IDs of the live regions.

func (c *Core) sendHandOff(sh int) {
	rec := c.table[sh]
	if r, ok := c.regions[rec.Source]; ok {
		c.steps[sh].sentAt = c.tick
		c.send(r, protocol.CmdHandOff, []int{sh}, []uint64{rec.Handoff})
	}
}

func (c *Core) sendBind(sh int) {
	rec := c.table[sh]
	if r, ok := c.regions[rec.Region]; ok {
		c.steps[sh].sentAt = c.tick
		c.send(r, protocol.CmdBind, []int{sh}, []uint64{rec.Handoff})
	}
}

func (c *Core) sendRelease(sh int) {
	rec := c.table[sh]
	if r, ok := c.regions[rec.Source]; ok {
		c.steps[sh].sentAt = c.tick
		c.send(r, protocol.CmdRelease, []int{sh}, []uint64{rec.Handoff})
	}
}

func (c *Core) sendBindBatch(region string, shards []int) {
	hs := make([]uint64, len(shards))
	for i, sh := range shards {
		hs[i] = c.table[sh].Handoff
	}
	c.send(c.regions[region], protocol.CmdBind, shards, hs)
}

func (c *Core) probeAll() {
	for _, id := range c.sortedRegionIDs() {
		c.probe(c.regions[id])
	}
}

func (c *Core) probe(r *regionState) {
	r.probedAt = c.tick
	c.send(r, protocol.CmdProbe, nil, nil)
}

func (c *Core) send(r *regionState, kind protocol.CommandKind, shards []int, handoffs []uint64) {
	c.out = append(c.out, Send{At: c.tick, Revision: r.Revision, Region: r.Info.ID, Command: protocol.Command{
		Kind: kind, Epoch: c.epoch, Coordinator: c.self, Incarnation: r.Info.Incarnation, Shards: shards, Handoffs: handoffs,
	}})
}

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
