package region

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/natshard/natshard/protocol"
)

// Riding through a lost connection (PROTOCOL.md): the core suspends its
// shards when the connection drops (or the region stalled, or its
// registration deadline passed with a renewal unanswered), and once it
// has renewed its registration and read the shard table (corereg.go), it
// keeps, pauses or drops each of them as its row says.

// errSuspended refuses a command while the region confirms its shards
// after a reconnect; the coordinator sends it again.
var errSuspended = errors.New("region suspended: reconnected to NATS, confirming its shards")

// suspend: the connection dropped. No shard is dropped: nothing crashed,
// and a shard dropped in the middle of a move made the region lose its
// place (PROTOCOL.md, Riding through a lost connection). Live shards are
// suspended; replaying ones stop delivering where they are; paused ones
// go on diverting (nats.go subscribes them again on reconnect). The
// commands waiting fail (the coordinator sends them again).
func (c *Core) suspend(ev Suspended) {
	c.suspended = true
	var live, moving []int
	for _, n := range c.held() {
		s := c.shards[n]
		switch s.mode {
		case modeLive:
			s.mode = modeSuspended
			c.emit(Suspend{Shard: n, Life: s.life})
			live = append(live, n)
		case modeHold:
			s.suspended = true
			c.emit(Suspend{Shard: n, Life: s.life})
			moving = append(moving, n)
		case modeDivert:
			s.suspended = true
			moving = append(moving, n)
		}
	}
	c.failWaiting(errSuspended)
	c.log(slog.LevelWarn, "suspended: serving no shard until it is confirmed after the reconnect", "reason", ev.Reason, "suspended", len(live), "moving", moving)
}

// verdict is what a confirmation does with a suspended shard.
type verdict uint8

const (
	keepShard  verdict = iota // as it was: live again, replaying again, or still diverting
	pauseShard                // paused for the row's handoff, as the handoff command would have
	dropShard                 // not this region's any more: dropped, what it held refused
)

// confirmVerdict decides what becomes of suspended shard s once the region
// has read its row (the zero row when the table has none). The table
// "gives" a shard to this region as its owner (Region and Incarnation:
// binding there, active there, or handoff from there) or as the source of
// a move (Source and SourceIncarnation: handoff or binding). The cases
// (PROTOCOL.md, Riding through a lost connection, has the table and why):
//
//   - live (suspended): owner of an active or binding row: live again.
//     Source of a handoff or binding row: the coordinator started a move
//     while the region was away and asks again; the shard pauses for the
//     row's handoff, what it held goes to the buffer first, in order.
//     Otherwise dropped.
//   - replaying: owner of a binding, active or handoff row: replays on
//     where it stopped (a handoff of a replaying shard waits until it is
//     live). Otherwise dropped.
//   - paused: source of a handoff or binding row, or a release under
//     way (the coordinator's own command): diverts on. Otherwise dropped.
//
// A row that names neither (parked, or bound, active or handing off
// elsewhere) means the coordinator took the shard without the region:
// a forced reallocation after a handoff timeout, or a removal, which the
// renewal before the read excludes.
func (c *Core) confirmVerdict(s *coreShard, r protocol.ShardRecord) verdict {
	mine := func(region, inc string) bool {
		return inc == c.incarnation && (c.cfg.Region == "" || region == c.cfg.Region)
	}
	owner, source := mine(r.Region, r.Incarnation), mine(r.Source, r.SourceIncarnation)
	switch s.mode {
	case modeSuspended:
		switch {
		case owner && (r.State == protocol.StateActive || r.State == protocol.StateBinding):
			return keepShard
		case source && (r.State == protocol.StateHandoff || r.State == protocol.StateBinding):
			return pauseShard
		}
	case modeHold:
		if owner && (r.State == protocol.StateBinding || r.State == protocol.StateActive || r.State == protocol.StateHandoff) {
			return keepShard
		}
	case modeDivert:
		if s.releasing != 0 || source && (r.State == protocol.StateHandoff || r.State == protocol.StateBinding) {
			return keepShard
		}
	}
	return dropShard
}

// confirmed ends a suspension: each suspended shard is kept, paused or
// dropped as its row in ev.Rows says (confirmVerdict).
func (c *Core) confirmed(ev Confirmed) {
	if !c.suspended || ev.Incarnation != c.incarnation {
		return
	}
	c.suspended = false
	rows := make(map[int]protocol.ShardRecord, len(ev.Rows))
	for _, r := range ev.Rows {
		rows[r.Shard] = r
	}
	var resumed, replaying, diverting, paused, dropped []int
	for _, n := range c.held() {
		s := c.shards[n]
		if s.mode != modeSuspended && !s.suspended {
			continue // not held through the suspension (none is: binds were refused)
		}
		r := rows[n]
		switch c.confirmVerdict(s, r) {
		case keepShard:
			s.suspended = false
			switch s.mode {
			case modeSuspended:
				s.mode = modeLive
				c.emit(Resume{Shard: n, Life: s.life})
				resumed = append(resumed, n)
			case modeHold:
				c.emit(Resume{Shard: n, Life: s.life})
				if s.caughtUp {
					s.mode, s.caughtUp = modeLive, false
					c.emit(GoLive{Shard: n, Life: s.life})
				}
				replaying = append(replaying, n)
			case modeDivert:
				if s.releasing == 0 && r.Handoff != 0 && r.Handoff != s.handoff {
					c.log(slog.LevelInfo, "shard already paused under another handoff id", "shard", n, "was", s.handoff, "now", r.Handoff)
					s.handoff = r.Handoff
				}
				diverting = append(diverting, n)
			}
		case pauseShard:
			// Where the handoff command, refused while suspended, would
			// have put it: the coordinator's next one finds it paused.
			s.mode, s.handoff, s.stopped = modeDivert, r.Handoff, false
			c.emit(Pause{Shard: n, Handoff: s.handoff, Life: s.life})
			paused = append(paused, n)
		case dropShard:
			dropped = append(dropped, c.unbind([]int{n}, fmt.Sprintf("the table gives it elsewhere after the reconnect (%s, region %q)", r.State, r.Region))...)
		}
	}
	c.log(slog.LevelInfo, "shards confirmed after the reconnect", "resumed", len(resumed), "replaying", replaying, "diverting", diverting, "paused", paused, "dropped", dropped)
}
