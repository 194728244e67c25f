package coordinator

import (
	"errors"
	"fmt"
	"slices"

	"github.com/natshard/natshard/protocol"
)

// This file holds resharding: the split of every shard into k children
// (docs/PROTOCOL.md, Resharding). The steps:
//
//  1. Reshard checks the gates (every shard active, nobody leaving, no
//     split under way) and commits: WriteConfig with the split's target
//     (To), then the rows of the new shards, copies of their parents'.
//  2. Every registered region is sent a split command, again every Retry
//     ticks until it answers that it split.
//  3. Once every registered region has, WriteConfig announces the new
//     count.
//
// Between 1 and 3 no move starts (no round, no leaving region's moves, no
// operator's move), parked shards are bound only to regions that split,
// and a probe of a region that has not split parks none of its children.
// A coordinator that takes over a split (its configuration has To) writes
// the rows still missing from their parents' (NewCore), then carries on
// at step 2.

// ErrSplitBusy: a split cannot start now (shards moving or parked, a
// region leaving); it may later, as it is.
var ErrSplitBusy = errors.New("coordinator: cannot split now")

// splitState is a split between its commit and its announce.
type splitState struct {
	from, to int
	// split: the regions (by id) that answered the split command, with
	// the incarnation that did; askedAt: when each was last asked.
	split   map[string]string
	askedAt map[string]int
}

// Reshard starts the split of every shard so that the type has n shards
// (shardctl reshard). It returns the actions that commit it (the fenced
// write of the configuration and the rows of the new shards) and the
// split commands; note says what follows. A split to n that is under way
// already is not an error. ErrSplitBusy says the gates are closed now.
func (c *Core) Reshard(n int) (acts []Action, note string, err error) {
	if c.split != nil {
		if c.split.to == n {
			return nil, fmt.Sprintf("a split to %d shards is under way", n), nil
		}
		return nil, "", fmt.Errorf("%w: a split to %d shards is under way", ErrSplitBusy, c.split.to)
	}
	if n == c.layout.Shards() {
		// Done already: a request sent again after its answer was lost
		// (the coordinator that took it died), or a repeated command.
		return nil, fmt.Sprintf("the type has %d shards already", n), nil
	}
	next, err := c.layout.To(n)
	if err != nil {
		return nil, "", fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	for sh, rec := range c.table {
		if rec.State != protocol.StateActive {
			why := "moving"
			if rec.State == protocol.StateParked || rec.State == protocol.StateUnowned {
				why = "parked (no region serves it)"
			}
			return nil, "", fmt.Errorf("%w: shard %d is %s; a split gives each child to its parent's region, so it waits until every shard is active", ErrSplitBusy, sh, why)
		}
	}
	for _, id := range c.sortedRegionIDs() {
		if c.regions[id].Info.Leaving {
			return nil, "", fmt.Errorf("%w: region %s is leaving; a split waits until it is gone or undrained", ErrSplitBusy, id)
		}
	}
	c.dropPlan("a split begins")
	from := c.layout.Shards()
	cfg := c.typeCfg
	cfg.To = n
	c.out = append(c.out, WriteConfig{Config: cfg})
	c.typeCfg, c.layout = cfg, next
	c.split = &splitState{from: from, to: n, split: map[string]string{}, askedAt: map[string]int{}}
	c.grow(from, n)
	c.stats.Splits.Add(1)
	c.askSplit()
	c.maybeAnnounce()
	return c.flush(), fmt.Sprintf("split from %d to %d shards recorded; each region splits its shards, then the coordinator announces the new count", from, n), nil
}

// grow extends the table from `from` to n shards: each new shard's row is
// its parent's (sh % from), written after the configuration that records
// the split and before anything else, so that a missing row's parent row
// is still the one it had at the commit.
func (c *Core) grow(from, n int) {
	for sh := from; sh < n; sh++ {
		c.table = append(c.table, protocol.ShardRecord{Shard: sh, State: protocol.StateUnowned})
		c.steps = append(c.steps, step{at: c.tick})
	}
	for sh := from; sh < n; sh++ {
		rec := c.table[sh%from]
		rec.Shard, rec.Epoch = sh, c.epoch
		c.write(rec)
	}
}

// takeOverSplit resumes a split whose commit a predecessor wrote (the
// configuration has To): the rows of table missing among the new shards
// are written from their parents', and the regions are asked to split.
func (c *Core) takeOverSplit(table []protocol.ShardRecord) {
	from, to := c.typeCfg.Shards, c.typeCfg.To
	c.split = &splitState{from: from, to: to, split: map[string]string{}, askedAt: map[string]int{}}
	have := make(map[int]bool, len(table))
	for _, r := range table {
		have[r.Shard] = true
	}
	for sh := from; sh < to; sh++ {
		if !have[sh] {
			rec := c.table[sh%from]
			rec.Shard, rec.Epoch = sh, c.epoch
			c.write(rec)
		}
	}
}

// askSplit sends the split command to every region that has not split,
// unless it was asked less than Retry ticks ago.
func (c *Core) askSplit() {
	s := c.split
	if s == nil {
		return
	}
	for _, id := range c.sortedRegionIDs() {
		r := c.regions[id]
		if s.split[id] == r.Info.Incarnation {
			continue
		}
		if at, ok := s.askedAt[id]; ok && c.tick-at < c.cfg.Retry {
			continue
		}
		s.askedAt[id] = c.tick
		c.out = append(c.out, Send{At: c.tick, Revision: r.Revision, Region: id, Command: protocol.Command{
			Kind: protocol.CmdSplit, Epoch: c.epoch, Coordinator: c.self, Incarnation: r.Info.Incarnation, Count: s.to,
		}})
	}
}

// splitDone takes a region's answer to the split command.
func (c *Core) splitDone(r *regionState, cmd protocol.Command, reply protocol.Reply) {
	s := c.split
	if s == nil || cmd.Count != s.to || len(reply.Replaying) > 0 {
		return // asked again by Tick (replaying: it splits once its shards are live)
	}
	s.split[r.Info.ID] = r.Info.Incarnation
	c.maybeAnnounce()
	c.allocate() // parked shards may now go to it
}

// maybeAnnounce announces the split once every registered region has split.
func (c *Core) maybeAnnounce() {
	s := c.split
	if s == nil {
		return
	}
	for _, id := range c.sortedRegionIDs() {
		if s.split[id] != c.regions[id].Info.Incarnation {
			return
		}
	}
	cfg := c.typeCfg
	cfg.History = append(slices.Clone(cfg.History), cfg.Shards)
	cfg.Shards, cfg.To = s.to, 0
	c.out = append(c.out, WriteConfig{Config: cfg})
	c.typeCfg, c.split = cfg, nil
	c.cfg.Shards = s.to
}

// hasSplit reports whether region id can be given the new shards: no split
// runs, or it split.
func (c *Core) hasSplit(id string) bool {
	if c.split == nil {
		return true
	}
	r, ok := c.regions[id]
	return ok && c.split.split[id] == r.Info.Incarnation
}

// Splitting returns the count a split under way goes to, 0 when none.
func (c *Core) Splitting() int {
	if c.split == nil {
		return 0
	}
	return c.split.to
}

// TypeConfig returns the type's configuration as the core last wrote it
// (or read it at takeover).
func (c *Core) TypeConfig() protocol.TypeConfig { return c.typeCfg }

// Layout returns the type's shard counts, the last the one the table has.
func (c *Core) Layout() protocol.Layout { return c.layout }
