package coordinator

import (
	"fmt"
	"slices"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// This file holds what the core learns of the regions: registrations
// that come and go, closed connections, commands that find no responder,
// the regions' answers to commands and probes, and the reconciliation of
// what a region holds with the table.

func (c *Core) regionUp(seen RegionSeen) {
	id := seen.Info.ID
	if old, ok := c.regions[id]; ok {
		if old.Info.Incarnation == seen.Info.Incarnation {
			if old.Info.Leaving != seen.Info.Leaving {
				c.flux()
			}
			if seen.Revision != old.Revision {
				// Renewed: the region is there (back from a reconnect, it
				// names its new connection); a removal at the old revision
				// would fail anyway.
				old.silent, old.connGone = false, false
			}
			old.RegionSeen = seen
			c.moveOffLeaving()
			return
		}
		// A new incarnation under the same id: the old one's shards are gone.
		c.regionGone(id)
	}
	c.regions[id] = &regionState{RegionSeen: seen, probedAt: c.tick}
	c.regionsChanged()
	c.flux()
	c.allocate()
}

// regionGone forgets a region and rescues its shards: those it owned are
// parked, moves from it are taken over, moves to it get another target.
func (c *Core) regionGone(id string) {
	r, ok := c.regions[id]
	if !ok {
		return
	}
	delete(c.regions, id)
	c.regionsChanged()
	c.flux()
	if c.split != nil {
		delete(c.split.split, id)
		delete(c.split.askedAt, id)
	}
	inc := r.Info.Incarnation
	for sh, rec := range c.table {
		isOwner := rec.Region == id && rec.Incarnation == inc
		isSource := rec.Source == id && rec.SourceIncarnation == inc
		switch {
		case rec.State == protocol.StateActive && isOwner:
			c.park(sh)
		case rec.State == protocol.StateHandoff && isSource:
			// It died pausing: its appends are in the buffer, no marker.
			// Or it is frozen: fenced, whatever it appends later is not
			// replayed.
			c.stats.HandOffsForced.Add(1)
			c.parkFenced(sh, rec.Handoff)
		case rec.State == protocol.StateBinding && isSource:
			c.sourceGone(sh)
		case rec.State == protocol.StateBinding && isOwner:
			c.retarget(sh)
		}
	}
	c.allocate()
	c.maybeAnnounce()
}

// connClosed probes the regions whose registration names the closed
// connection, now and at the next tick (in a cluster the report may reach
// the coordinator before the end of the region's interest reaches every
// server: a probe then times out rather than find no responders).
func (c *Core) connClosed(ev ConnClosed) {
	if ev.Conn.IsZero() {
		return
	}
	for _, id := range c.sortedRegionIDs() {
		if r := c.regions[id]; r.Info.Conn == ev.Conn {
			r.connGone = r.connGone || ev.ByClient
			c.probe(r)
			r.probedAt = c.tick - c.cfg.ProbeEvery + 1
		}
	}
}

// silence counts a "no responders" to command s of region r: the
// region's subscriptions are gone from the servers. Its connection may be
// coming back (a client reconnects to another server within
// milliseconds, and a region rides that through), so the region is probed
// every tick and removed once it has been silent for Silence ticks, or at
// once when a server reported that its client closed or reset it. The
// removal is a compare-and-delete at the revision of the registration
// when the silence began: a region that renewed since keeps it. Its
// shards are rescued when the watch reports the registration gone.
func (c *Core) silence(r *regionState, s Send) {
	if !r.silent {
		r.silent, r.silentAt, r.silentRev = true, s.At, s.Revision
	}
	if r.connGone || s.At-r.silentAt >= c.cfg.Silence {
		c.out = append(c.out, RemoveRegion{ID: r.Info.ID, Revision: r.silentRev})
		return
	}
	r.probedAt = c.tick - c.cfg.ProbeEvery + 1 // probe it again at the next tick
}

// sourceGone: the source of a binding shard died before it wrote its end
// marker. The target is subscribed and holds what arrives since, so the
// coordinator writes the marker for the source.
func (c *Core) sourceGone(sh int) {
	c.stats.HandOffsForced.Add(1)
	rec := c.table[sh]
	if !c.live(rec.Region, rec.Incarnation) {
		c.parkFenced(sh, rec.Handoff)
		return
	}
	rec.Source, rec.SourceIncarnation = "", ""
	c.write(rec)
	c.out = append(c.out, Mark{Shard: sh, Handoff: rec.Handoff, Fence: true})
}

func (c *Core) commandDone(ev CommandDone) {
	s := ev.Send
	r, ok := c.regions[s.Region]
	if !ok || r.Info.Incarnation != s.Command.Incarnation {
		return // about a region or incarnation that is gone: nothing to do
	}
	if ev.Outcome != NoResponders {
		r.silent = false // it answered, or the outcome proves nothing (a timeout)
	}
	switch ev.Outcome {
	case NoResponders:
		c.silence(r, s)
		return
	case Failed:
		return // resent by Tick
	case Refused:
		if ev.Reply.Epoch > c.epoch {
			c.out = append(c.out, StepDown{Reason: fmt.Sprintf("region %s has seen epoch %d, newer than %d", s.Region, ev.Reply.Epoch, c.epoch)})
			return
		}
		if ev.Reply.Incarnation != "" && ev.Reply.Incarnation != r.Info.Incarnation {
			// The process behind the id restarted; its new registration
			// arrives through the watch.
			c.regionGone(s.Region)
		}
		return // other refusals: resent by Tick
	}
	cmd := s.Command
	for i, sh := range cmd.Shards {
		rec := c.table[sh]
		var h uint64
		if i < len(cmd.Handoffs) {
			h = cmd.Handoffs[i]
		}
		switch cmd.Kind {
		case protocol.CmdHandOff:
			if rec.State != protocol.StateHandoff || rec.Handoff != h || rec.Source != s.Region {
				break
			}
			if ev.Reply.Complete {
				c.steps[sh].complete = true
				c.chooseTarget(sh, rec.Source)
			} else if slices.Contains(ev.Reply.Replaying, sh) {
				// The source is still replaying the shard's previous move:
				// busy, not stuck. Forcing the move now would drop what
				// it holds; the timeout counts from when it is live.
				c.steps[sh].at = c.tick
			}
		case protocol.CmdBind:
			if rec.State == protocol.StateBinding && rec.Handoff == h && rec.Region == s.Region && !c.steps[sh].bound {
				c.steps[sh].bound = true
				if rec.Source == "" {
					c.out = append(c.out, Unpark{Shard: sh, Handoff: h, Live: slices.Contains(ev.Reply.Live, sh)})
				} else {
					c.sendRelease(sh)
				}
			}
		case protocol.CmdRelease:
			if rec.State == protocol.StateBinding && rec.Handoff == h && rec.Source == s.Region {
				c.stats.HandOffsCompleted.Add(1)
				c.activate(sh)
			}
		}
	}
	switch cmd.Kind {
	case protocol.CmdProbe:
		c.recordLoad(r, ev.Reply.Load)
		c.reconcile(r, ev.Reply.Held, s.At)
	case protocol.CmdSplit:
		c.splitDone(r, cmd, ev.Reply)
	}
}

// recordLoad keeps the loads a region reported for the shards it owns and
// serves. A shard keeps its last known load when it moves, until its new
// owner has measured it.
func (c *Core) recordLoad(r *regionState, loads []protocol.ShardLoad) {
	for _, l := range loads {
		if l.Shard < 0 || l.Shard >= len(c.table) {
			continue
		}
		if rec := c.table[l.Shard]; rec.State == protocol.StateActive && rec.Region == r.Info.ID && rec.Incarnation == r.Info.Incarnation {
			c.load[l.Shard] = strategies.ShardLoad{MessagesPerSecond: l.Rate, Entities: l.Entities}
		}
	}
}

// reconcile compares what a region said it holds, in answer to a probe
// sent at tick at, with the table: a shard it holds without reason is
// dropped; a shard that was already active on it when the probe was sent
// and that it does not hold is parked and allocated again. (Commands run
// concurrently, so a probe may overtake the Bind of a shard.)
func (c *Core) reconcile(r *regionState, held []int, at int) {
	has := make(map[int]bool, len(held))
	var drop []int
	for _, sh := range held {
		if sh < 0 || sh >= len(c.table) {
			continue
		}
		has[sh] = true
		rec := c.table[sh]
		owner := rec.Region == r.Info.ID && rec.Incarnation == r.Info.Incarnation
		source := rec.Source == r.Info.ID && rec.SourceIncarnation == r.Info.Incarnation
		if !owner && !source {
			drop = append(drop, sh)
		}
	}
	if len(drop) > 0 {
		c.send(r, protocol.CmdDrop, drop, nil)
	}
	for _, sh := range c.rowsOf(r.Info.ID) {
		if c.split != nil && sh >= c.split.from && !c.hasSplit(r.Info.ID) {
			continue // a child of a shard it holds: it serves it once it split
		}
		if rec := c.table[sh]; rec.State == protocol.StateActive && rec.Incarnation == r.Info.Incarnation && !has[sh] && c.steps[sh].at < at {
			c.park(sh)
		}
	}
	c.allocate()
}
