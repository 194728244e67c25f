package region

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/nats-io/nuid"

	"github.com/natshard/natshard/protocol"
)

// Core decides what the region does with its shards and its
// registration: which shards to bind, pause, release and drop, when to
// answer the coordinator and what, when to register, renew, fence,
// suspend and confirm (corereg.go). It takes events (the coordinator's
// commands, the outcome of an epoch check, a replay caught up, entities
// stopped, a release done, a registration write's outcome, a fence, a
// lost connection, ticks) and returns the actions to carry out, in order.
// It does no I/O and reads no clock (time comes in with Tick and the
// outcome events), so the same inputs give the same outputs; its tests
// are scenarios without NATS (core_test.go, corereg_test.go) and a
// simulation (sim_test.go). The Agent's driver goroutine owns it; it is
// not safe for concurrent use.
//
// Every command is idempotent: the coordinator resends a command until it
// gets an answer without error. A command with an epoch newer than any
// seen is held, with every command after it, until the driver checked
// that epoch against the coordinator lease (CheckEpoch): a holder of
// region credentials could otherwise forge a high epoch and make the real
// coordinator's commands stale.
type Core struct {
	cfg CoreConfig

	registered  bool
	incarnation string
	maxEpoch    uint64
	leaving     bool // in the registration: the coordinator moves the shards off
	going       bool // Leave: the process is stopping; never undrained
	closed      bool
	// suspended: the connection dropped (Suspended) and the region has not
	// confirmed its shards since (Confirmed): commands but Probe and Drop
	// are refused, so that nothing starts before the region knows which
	// of its shards are still its own.
	suspended bool

	shards map[int]*coreShard
	life   uint64 // counts binds: each bind of a shard is a new life

	checking uint64                    // the epoch being checked; 0: none
	queued   []CommandIn               // commands waiting for the check
	binds    map[uint64]protocol.Reply // bind (and split) answers waiting for Bound
	// splitting: split commands waiting for their check against the
	// stored configuration (split.go).
	splitting map[uint64]protocol.Reply
	handoffs  []*handoffAnswer
	releases  []*releaseAnswer
	token     uint64 // counts Release actions
	tick      int
	reg       registration // the registration life cycle (corereg.go)
	out       []Action
}

// CoreConfig configures a Core.
type CoreConfig struct {
	Shards int // the type's shard count
	// Region is the region's id: a confirmation after a reconnect (see
	// Confirmed) reads the table's rows that name it. Empty: rows are
	// matched by incarnation alone (incarnations are unique).
	Region string
	// HandOffWait: ticks a HandOff answer waits for the paused shards'
	// entities to stop before it says Complete=false (default 20).
	HandOffWait int
	// LeaseTTL is the registration's TTL (corereg.go); 0: the core has
	// no deadline and never renews nor registers by itself (the tests of
	// its commands).
	LeaseTTL time.Duration
	// Version and Instance go into the registration (protocol.RegionInfo).
	Version, Instance string
	// NewIncarnation names a new incarnation (default nuid.Next).
	NewIncarnation func() string
	// ServeOnAtDeadline: when the registration deadline passes with a
	// renewal unanswered, serve on until its outcome (which the renewal's
	// own deadline bounds) instead of suspending and then confirming the
	// shards against the table: for an Agent without a stall watch
	// (Config.StallLimit < 0: tests that play the coordinator without a
	// shard table, which a confirmation would empty).
	ServeOnAtDeadline bool
}

// coreShard is a held shard.
type coreShard struct {
	mode      mode
	handoff   uint64 // hold: the marker it replays to; divert: the handoff it is paused for
	life      uint64
	stopped   bool   // divert: its entities have stopped
	releasing uint64 // the token of the Release under way; 0: none
	// suspended: a shard in the middle of a move (hold, divert) riding
	// through a lost connection until the region confirms it (a live one
	// is modeSuspended instead). A replaying one delivers nothing
	// meanwhile and keeps its place; a paused one keeps diverting.
	suspended bool
	// caughtUp: hold, suspended: its replay reached the marker; it goes
	// live once confirmed.
	caughtUp bool
}

type handoffAnswer struct {
	id       uint64
	reply    protocol.Reply
	wait     map[int]uint64 // shard -> life whose entities must stop
	deadline int
}

type releaseAnswer struct {
	id      uint64
	reply   protocol.Reply
	pending map[uint64]bool // Release tokens not done
	errs    []error
}

// NewCore returns a core of a region that is registered as incarnation
// (its last renewal sent at the zero time), or, when incarnation is "",
// one not registered yet, whose first registration Start begins.
func NewCore(cfg CoreConfig, incarnation string) *Core {
	if cfg.HandOffWait <= 0 {
		cfg.HandOffWait = 20
	}
	if cfg.NewIncarnation == nil {
		cfg.NewIncarnation = nuid.Next
	}
	return &Core{cfg: cfg, registered: incarnation != "", incarnation: incarnation, shards: map[int]*coreShard{}, binds: map[uint64]protocol.Reply{}}
}

// Step takes one event and returns the actions it causes.
func (c *Core) Step(ev Event) []Action {
	c.out = nil
	switch ev := ev.(type) {
	case CommandIn:
		c.command(ev)
	case EpochChecked:
		c.epochChecked(ev)
	case Bound:
		c.bound(ev)
	case SplitChecked:
		c.splitChecked(ev)
	case CaughtUp:
		c.caughtUp(ev)
	case SplitLive:
		for i, n := range ev.Shards {
			c.caughtUp(CaughtUp{Shard: n, Life: ev.Lives[i]})
		}
	case EntitiesStopped:
		if s := c.shards[ev.Shard]; s != nil && s.life == ev.Life && s.mode == modeDivert {
			s.stopped = true
		}
		c.answerHandoffs()
	case ReleaseDone:
		c.releaseDone(ev)
	case RegisterDone:
		c.registerDone(ev)
	case RenewDone:
		c.renewDone(ev)
	case Reconnected:
		c.reconnected()
	case Fenced:
		if ev.Incarnation == "" || ev.Incarnation == c.incarnation {
			c.fence(ev.Reason)
		}
	case SourceFenced:
		if s := c.shards[ev.Shard]; s != nil && s.life == ev.Life && s.mode == modeDivert {
			c.unbind([]int{ev.Shard}, "its handoff was fenced: the coordinator took it over")
			c.log(slog.LevelWarn, "dropped a shard paused for a handoff that the coordinator had fenced (it timed out while this region was stalled): the shard is another's now", "shard", ev.Shard, "handoff", s.handoff)
			c.answerHandoffs()
		}
	case Suspended:
		c.onSuspended(ev)
	case Confirmed:
		c.confirmedEv(ev)
	case Leaving:
		c.leavingEv(ev)
	case Closing:
		c.closingEv(ev)
	}
	c.leftCheck()
	return c.out
}

// caughtUp: a shard's replay (or its split's eviction) is done: it goes
// live, or, while the region is suspended, once confirmed.
func (c *Core) caughtUp(ev CaughtUp) {
	if s := c.shards[ev.Shard]; s != nil && s.life == ev.Life && s.mode == modeHold {
		if s.suspended {
			s.caughtUp = true // live once confirmed
			return
		}
		s.mode = modeLive
		c.emit(GoLive(ev))
	}
}

// Tick advances the core's clock by one tick, at now: handoff answers
// whose wait ran out, the registration's renewals and deadline.
func (c *Core) Tick(now time.Time) []Action {
	c.out = nil
	c.tick++
	c.later(now)
	c.answerHandoffs()
	c.tickRegistration()
	c.leftCheck()
	return c.out
}

// Held returns the shards the region holds (serving, replaying or
// handing off), ascending.
func (c *Core) Held() []int { return c.held() }

// Leaving reports whether the registration carries the leaving mark.
func (c *Core) Leaving() bool { return c.leaving }

// Epoch is the newest coordinator epoch whose command the region obeyed.
func (c *Core) Epoch() uint64 { return c.maxEpoch }

// Mode returns how the region holds shard n (modeGone: not at all).
func (c *Core) Mode(n int) mode {
	if s := c.shards[n]; s != nil {
		return s.mode
	}
	return modeGone
}

func (c *Core) emit(a Action) { c.out = append(c.out, a) }

func (c *Core) log(level slog.Level, msg string, args ...any) {
	c.emit(Log{Level: level, Msg: msg, Args: args})
}

func (c *Core) held() []int {
	held := make([]int, 0, len(c.shards))
	for n := range c.shards {
		held = append(held, n)
	}
	slices.Sort(held)
	return held
}

// command takes a command in arrival order: behind an epoch check under
// way, or behind its own.
func (c *Core) command(ev CommandIn) {
	if ev.Err != nil {
		c.emit(Answer{ID: ev.ID, Reply: protocol.Reply{Incarnation: c.incarnation, Epoch: c.maxEpoch, Error: ev.Err.Error()}, Refused: true})
		return
	}
	if c.checking != 0 {
		c.queued = append(c.queued, ev)
		return
	}
	if ev.Cmd.Epoch > c.maxEpoch && c.registered && !c.closed {
		c.checking = ev.Cmd.Epoch
		c.queued = append(c.queued, ev)
		c.emit(CheckEpoch{Epoch: ev.Cmd.Epoch})
		return
	}
	c.run(ev, nil)
}

// epochChecked takes the outcome of the check under way, then the
// commands that waited for it, in order (one of them may start another).
func (c *Core) epochChecked(ev EpochChecked) {
	if ev.Epoch != c.checking {
		return
	}
	c.checking = 0
	if ev.Err == nil {
		c.maxEpoch = max(c.maxEpoch, ev.Epoch)
	}
	queued := c.queued
	c.queued = nil
	for i, q := range queued {
		if c.checking != 0 {
			c.queued = append(c.queued, queued[i:]...)
			return
		}
		var epochErr error
		if ev.Err != nil && q.Cmd.Epoch == ev.Epoch {
			epochErr = ev.Err
		}
		if epochErr == nil && q.Cmd.Epoch > c.maxEpoch && c.registered && !c.closed {
			c.checking = q.Cmd.Epoch
			c.queued = append(c.queued, queued[i:]...)
			c.emit(CheckEpoch{Epoch: q.Cmd.Epoch})
			return
		}
		c.run(q, epochErr)
	}
}

// run carries out a command whose epoch is known good (or not: epochErr).
func (c *Core) run(ev CommandIn, epochErr error) {
	cmd := ev.Cmd
	reply := protocol.Reply{Incarnation: c.incarnation}
	switch {
	case epochErr != nil:
		reply.Error = epochErr.Error()
	case c.closed:
		reply.Error = "region is closing"
	case !c.registered:
		reply.Error = errNotRegistered.Error()
	case c.suspended && cmd.Kind != protocol.CmdProbe && cmd.Kind != protocol.CmdDrop:
		reply.Error = errSuspended.Error()
	case cmd.Epoch < c.maxEpoch:
		reply.Error = fmt.Sprintf("stale epoch %d: have seen %d", cmd.Epoch, c.maxEpoch)
	case cmd.Incarnation != c.incarnation:
		reply.Error = fmt.Sprintf("command for incarnation %s, this is %s", cmd.Incarnation, c.incarnation)
	}
	if reply.Error != "" {
		reply.Epoch = c.maxEpoch
		c.log(slog.LevelWarn, "refused a command", "kind", cmd.Kind, "epoch", cmd.Epoch, "why", reply.Error)
		c.emit(Answer{ID: ev.ID, Reply: reply, Refused: true})
		return
	}
	c.maxEpoch = cmd.Epoch
	reply.Epoch = cmd.Epoch
	answer := func(err error) {
		if err != nil {
			reply.Error = err.Error()
		}
		reply.Held = c.held()
		c.emit(Answer{ID: ev.ID, Reply: reply, Probe: cmd.Kind == protocol.CmdProbe})
	}
	switch cmd.Kind {
	case protocol.CmdProbe:
		answer(nil)
	case protocol.CmdBind:
		c.bind(ev.ID, cmd, &reply, answer)
	case protocol.CmdDrop:
		if dropped := c.unbind(cmd.Shards, "dropped by the coordinator"); len(dropped) > 0 {
			c.log(slog.LevelInfo, "dropped shards", "shards", dropped, "epoch", cmd.Epoch)
		}
		answer(nil)
	case protocol.CmdHandOff:
		c.handOff(ev.ID, cmd, &reply, answer)
	case protocol.CmdRelease:
		c.release(ev.ID, cmd, &reply, answer)
	case protocol.CmdLeave:
		if !c.leaving {
			c.log(slog.LevelInfo, "region leaving, as the coordinator asked")
		}
		c.leaving = true
		c.write(waiter{id: ev.ID})
	case protocol.CmdSplit:
		c.splitCommand(ev.ID, cmd, &reply, answer)
	case protocol.CmdUndrain:
		switch {
		case c.going:
			answer(errors.New("undrain refused: the region's process is stopping"))
		case len(c.shards) > 0:
			answer(fmt.Errorf("undrain refused: the region still holds shards %v (it is being drained, or its process is stopping); undrain it once it holds none", c.held()))
		default:
			if c.leaving {
				c.log(slog.LevelInfo, "region takes shards again, as the coordinator asked (undrain)")
			}
			c.leaving = false
			c.write(waiter{id: ev.ID})
		}
	default:
		answer(fmt.Errorf("unknown command %s", cmd.Kind))
	}
}

// bind binds the command's shards that are not held yet, each to be
// replayed up to its handoff's end marker; a shard held already (live or
// replaying) is left as it is. The answer waits for the subscriptions to
// be flushed (Bound), so that the server knows them before the
// coordinator hears that they exist. A bind of a shard paused here is
// refused whole.
func (c *Core) bind(id uint64, cmd protocol.Command, reply *protocol.Reply, answer func(error)) {
	for _, n := range cmd.Shards {
		if s := c.shards[n]; s != nil && s.mode == modeDivert {
			answer(fmt.Errorf("bind of shard %d refused: it is paused for a handoff here; release or drop it first", n))
			return
		}
	}
	b := BindShards{ID: id}
	for i, n := range cmd.Shards {
		if s, ok := c.shards[n]; ok {
			if s.mode == modeLive {
				reply.Live = append(reply.Live, n)
			}
			continue
		}
		c.life++
		c.shards[n] = &coreShard{mode: modeHold, handoff: cmd.Handoffs[i], life: c.life}
		b.Shards = append(b.Shards, n)
		b.Handoffs = append(b.Handoffs, cmd.Handoffs[i])
		b.Lives = append(b.Lives, c.life)
	}
	if len(b.Shards) == 0 {
		answer(nil)
		return
	}
	c.binds[id] = *reply
	c.emit(b)
	c.log(slog.LevelDebug, "bound shards; replaying their buffers", "shards", b.Shards, "handoffs", b.Handoffs, "epoch", cmd.Epoch)
}

// bound answers a bind once its subscriptions are flushed; the shards that
// could not be bound are forgotten.
func (c *Core) bound(ev Bound) {
	// The shards that could not be bound are forgotten even when nobody
	// waits for the answer any more (a suspension failed it).
	for _, n := range ev.Failed {
		if s := c.shards[n]; s != nil && s.mode == modeHold {
			delete(c.shards, n)
		}
	}
	reply, ok := c.binds[ev.ID]
	if !ok {
		return
	}
	delete(c.binds, ev.ID)
	if ev.Err != nil {
		reply.Error = ev.Err.Error()
		c.log(slog.LevelWarn, "cannot bind shards; the coordinator will ask again", "shards", ev.Failed, "err", ev.Err)
	}
	reply.Held = c.held()
	c.emit(Answer{ID: ev.ID, Reply: reply})
}

// handOff pauses the command's live shards (docs/PROTOCOL.md, "Handoff", step
// 2): from now on their arrivals go to the buffer and their entities stop. The
// answer says Complete when every entity of the shards has stopped: at once,
// or when they have, or Complete=false after HandOffWait ticks. A shard that
// is still replaying is left alone, reported in Replaying, and makes the
// answer incomplete at once (the coordinator asks again). A shard not held has
// nothing to stop. A repeated HandOff restarts nothing.
func (c *Core) handOff(id uint64, cmd protocol.Command, reply *protocol.Reply, answer func(error)) {
	wait := map[int]uint64{}
	var paused, replaying []int
	for i, n := range cmd.Shards {
		s := c.shards[n]
		if s == nil {
			continue
		}
		switch s.mode {
		case modeHold:
			replaying = append(replaying, n)
		case modeLive:
			s.mode, s.handoff, s.stopped = modeDivert, cmd.Handoffs[i], false
			c.emit(Pause{Shard: n, Handoff: s.handoff, Life: s.life})
			paused = append(paused, n)
		case modeDivert:
			if s.handoff != cmd.Handoffs[i] {
				c.log(slog.LevelInfo, "shard already paused under another handoff id", "shard", n, "was", s.handoff, "now", cmd.Handoffs[i])
				s.handoff = cmd.Handoffs[i]
			}
		}
		if s.mode == modeDivert && !s.stopped {
			wait[n] = s.life
		}
	}
	if len(paused) > 0 {
		c.log(slog.LevelDebug, "paused shards for handoff: buffering their messages", "shards", paused, "epoch", cmd.Epoch)
	}
	switch {
	case len(replaying) > 0:
		reply.Replaying = replaying
		answer(nil)
	case len(wait) == 0:
		reply.Complete = true
		answer(nil)
	default:
		c.handoffs = append(c.handoffs, &handoffAnswer{id: id, reply: *reply, wait: wait, deadline: c.tick + c.cfg.HandOffWait})
	}
}

// answerHandoffs answers the waiting handoffs whose entities have stopped
// (Complete), or whose wait ran out (not Complete).
func (c *Core) answerHandoffs() {
	c.handoffs = slices.DeleteFunc(c.handoffs, func(h *handoffAnswer) bool {
		for n, life := range h.wait {
			if s := c.shards[n]; s == nil || s.life != life || s.stopped {
				delete(h.wait, n) // stopped, or gone (dropped: stopping on its own)
			}
		}
		switch {
		case len(h.wait) == 0:
			h.reply.Complete = true
		case c.tick < h.deadline:
			return false
		}
		h.reply.Held = c.held()
		c.emit(Answer{ID: h.id, Reply: h.reply})
		return true
	})
}

// failWaiting answers every waiting handoff and bind with err (fenced,
// closing).
func (c *Core) failWaiting(err error) {
	for _, h := range c.handoffs {
		h.reply.Error = err.Error()
		h.reply.Held = c.held()
		c.emit(Answer{ID: h.id, Reply: h.reply})
	}
	c.handoffs = nil
	for _, id := range slices.Sorted(maps.Keys(c.binds)) {
		reply := c.binds[id]
		reply.Error = err.Error()
		reply.Held = c.held()
		c.emit(Answer{ID: id, Reply: reply})
	}
	clear(c.binds)
}

// release ends the source's part of a handoff (docs/PROTOCOL.md, "Handoff",
// step 5) for the command's shards. It refuses the whole command, changing
// nothing, when one of them is live or replaying here (the coordinator
// releases only a shard it paused). A shard held here is released (Release
// with Held); a shard not held gets its end marker all the same (harmless when
// it is already there), so that a new owner never waits for it forever. A
// repeated Release joins the one under way. The answer waits for them all.
func (c *Core) release(id uint64, cmd protocol.Command, reply *protocol.Reply, answer func(error)) {
	for _, n := range cmd.Shards {
		if s := c.shards[n]; s != nil && s.mode != modeDivert {
			answer(fmt.Errorf("release of shard %d refused: it is %s here, not paused for a handoff", n, s.mode))
			return
		}
	}
	r := &releaseAnswer{id: id, reply: *reply, pending: map[uint64]bool{}}
	for i, n := range cmd.Shards {
		s := c.shards[n]
		if s != nil && s.releasing != 0 {
			r.pending[s.releasing] = true
			continue
		}
		c.token++
		r.pending[c.token] = true
		if s != nil {
			s.releasing = c.token
		}
		c.emit(Release{Token: c.token, Shard: n, Handoff: cmd.Handoffs[i], Held: s != nil})
	}
	c.releases = append(c.releases, r)
}

// releaseDone forgets a released shard and answers the releases that
// waited for it.
func (c *Core) releaseDone(ev ReleaseDone) {
	for n, s := range c.shards {
		if s.releasing == ev.Token {
			delete(c.shards, n)
		}
	}
	c.releases = slices.DeleteFunc(c.releases, func(r *releaseAnswer) bool {
		if !r.pending[ev.Token] {
			return false
		}
		delete(r.pending, ev.Token)
		if ev.Err != nil {
			r.errs = append(r.errs, ev.Err)
		}
		if len(r.pending) > 0 {
			return false
		}
		if err := errors.Join(r.errs...); err != nil {
			r.reply.Error = err.Error()
		}
		r.reply.Held = c.held()
		c.emit(Answer{ID: r.id, Reply: r.reply})
		return true
	})
}

// unbind stops serving the shards at once, in whatever mode, and forgets
// them; no end marker. (A release under way still writes its marker, and
// answers.) It returns the shards it unbound.
func (c *Core) unbind(shards []int, why string) []int {
	var done []int
	for _, n := range shards {
		s := c.shards[n]
		if s == nil {
			continue
		}
		delete(c.shards, n)
		c.emit(Unbind{Shard: n, Life: s.life, Why: why})
		done = append(done, n)
	}
	return done
}

func (c *Core) unbindAll(why string) []int { return c.unbind(c.held(), why) }
