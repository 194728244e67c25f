package region

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// regionSim drives a Core through whole histories without NATS: a
// registration store and a shard table in memory, a coordinator that
// follows the protocol (it gives a shard away only once the region
// released it, once the region's registration expired on the server, or,
// by force, while the region cannot be reached), a connection that drops
// and comes back, and I/O whose outcomes come in any order, late, or
// failed. After every step it checks the region's guarantees:
//
//   - it never serves a shard past its registration's deadline, nor once
//     the server could have let the registration expire;
//   - it never serves a shard that the table gives another region;
//   - it leaves nothing suspended for ever: once the network heals and
//     the I/O works, every suspension ends (confirmed or fenced).
//
// "Serves" is the data plane's view (world: GoLive and Resume, not
// undone by Suspend, Pause or Unbind since), not the core's.
type regionSim struct {
	*world
	rng       *rand.Rand
	now       time.Time
	ttl       time.Duration
	connected bool
	failP     float64 // the chance that an I/O outcome is a failure
	incs      int

	// The server: the registration and the shard table.
	stored   *protocol.RegionInfo
	rev      uint64
	storedAt time.Time
	table    map[int]protocol.ShardRecord

	pending []simIO
	// The coordinator: commands waiting for their answer.
	sent     map[uint64]protocol.Command
	handoffs uint64
	log      []string
	signals  map[chan struct{}]bool // Signal actions: whether a registration write was under way then
}

// simIO is an action of the core under way: done gives its outcome,
// failed or not.
type simIO struct {
	what string
	done func(fail bool) Event
}

const simRegionID = "r"

func newRegionSim(t *testing.T, seed uint64) *regionSim {
	s := &regionSim{
		rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC),
		ttl: 4 * time.Second, connected: true, table: map[int]protocol.ShardRecord{}, sent: map[uint64]protocol.Command{}, signals: map[chan struct{}]bool{},
	}
	c := NewCore(CoreConfig{Shards: 8, Region: simRegionID, HandOffWait: 5, LeaseTTL: s.ttl, Instance: "me", NewIncarnation: func() string {
		s.incs++
		return fmt.Sprintf("inc%d", s.incs)
	}}, "")
	s.world = &world{t: t, c: c, answers: map[uint64]protocol.Reply{}, refused: map[uint64]bool{}, live: map[int]bool{}, suspended: map[int]bool{}, wasLive: map[int]bool{}}
	for n := range 8 {
		s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateParked}
	}
	s.run(c.Start(s.now))
	s.deliverAll()
	if !c.Registered() {
		t.Fatal("the first registration failed")
	}
	return s
}

func (s *regionSim) logf(format string, args ...any) {
	s.log = append(s.log, fmt.Sprintf("%s ", s.now.Format("05.000"))+fmt.Sprintf(format, args...))
}

// step gives the core an event and carries out what it returns.
func (s *regionSim) step(ev Event) {
	s.t.Helper()
	s.logf("%T%+v", ev, ev)
	s.run(s.c.Step(ev))
}

// tick advances the clock by d and ticks the core.
func (s *regionSim) tick(d time.Duration) {
	s.t.Helper()
	s.now = s.now.Add(d)
	s.logf("tick +%s", d)
	s.run(s.c.Tick(s.now))
}

// run records the actions (world.record checks them) and starts their I/O.
func (s *regionSim) run(acts []Action) {
	s.t.Helper()
	s.world.record(acts)
	for _, a := range acts {
		if _, ok := a.(Log); !ok {
			s.logf("  -> %T%+v", a, a)
		}
		switch a := a.(type) {
		case Register:
			sent := s.now
			s.io("register", func(fail bool) Event {
				if fail || !s.connected {
					return RegisterDone{Token: a.Token, Sent: sent, At: s.now, Err: errors.New("timeout")}
				}
				s.write(a.Info)
				return RegisterDone{Token: a.Token, Lease: kvstate.Lease{Revision: s.rev, TTL: a.TTL}, Sent: sent, At: s.now}
			})
		case Renew:
			sent := s.now
			s.io("renew", func(fail bool) Event {
				ev := RenewDone{Token: a.Token, Sent: sent, At: s.now}
				switch {
				case !s.connected || s.now.After(a.Deadline):
					ev.Err = errors.New("timeout")
				case s.stored == nil || s.rev != a.Lease.Revision:
					ev.Err, ev.Conflict = kvstate.ErrConflict, true
				case fail:
					// Stored, but the answer was lost, half the time.
					if s.rng.IntN(2) == 0 {
						s.write(a.Info)
					}
					ev.Err = errors.New("timeout")
				default:
					s.write(a.Info)
					ev.Lease = kvstate.Lease{Revision: s.rev, TTL: s.ttl}
				}
				return ev
			})
		case ReadTable:
			// Read at once; its outcome may come much later, after the
			// connection dropped again and the table changed.
			var rows []protocol.ShardRecord
			for n := range 8 {
				rows = append(rows, s.table[n])
			}
			read := s.connected
			s.io("read table", func(fail bool) Event {
				if fail || !read {
					return Confirmed{Incarnation: a.Incarnation, Drops: a.Drops, Err: errors.New("timeout")}
				}
				return Confirmed{Incarnation: a.Incarnation, Drops: a.Drops, Rows: rows}
			})
		case CheckEpoch:
			s.io("check epoch", func(bool) Event { return EpochChecked{Epoch: a.Epoch} })
		case BindShards:
			s.io("bound", func(bool) Event { return Bound{ID: a.ID} })
			for i, n := range a.Shards {
				s.io("caught up", func(bool) Event { return CaughtUp{Shard: n, Life: a.Lives[i]} })
			}
		case Pause:
			s.io("entities stopped", func(bool) Event { return EntitiesStopped{Shard: a.Shard, Life: a.Life} })
		case Release:
			s.io("release", func(fail bool) Event {
				if fail {
					return ReleaseDone{Token: a.Token, Err: errors.New("timeout")}
				}
				return ReleaseDone{Token: a.Token}
			})
		case Fail:
			s.t.Fatalf("the region failed: %v", a.Err)
		case Signal:
			s.signals[a.Ch] = s.c.Writing() || slices.ContainsFunc(s.pending, func(io simIO) bool { return io.what == "renew" || io.what == "register" })
		}
	}
	s.coordinate()
	s.check()
}

func (s *regionSim) io(what string, done func(fail bool) Event) {
	s.pending = append(s.pending, simIO{what: what, done: done})
}

// write stores the registration.
func (s *regionSim) write(info protocol.RegionInfo) {
	s.rev++
	s.stored, s.storedAt = &info, s.now
}

// deliver gives the core the outcome of one I/O under way, at random.
func (s *regionSim) deliver() {
	if len(s.pending) == 0 {
		return
	}
	i := s.rng.IntN(len(s.pending))
	io := s.pending[i]
	s.pending = slices.Delete(s.pending, i, i+1)
	s.step(io.done(s.rng.Float64() < s.failP))
}

func (s *regionSim) deliverAll() {
	for len(s.pending) > 0 {
		s.deliver()
	}
}

// send sends a command of the coordinator (lost while disconnected).
func (s *regionSim) send(kind protocol.CommandKind, shards []int, handoffs []uint64) {
	if !s.connected || s.stored == nil {
		return
	}
	s.world.id++
	cmd := protocol.Command{Kind: kind, Epoch: 1, Incarnation: s.stored.Incarnation, Shards: shards, Handoffs: handoffs}
	s.sent[s.world.id] = cmd
	s.step(CommandIn{ID: s.world.id, Cmd: cmd})
}

// coordinate is the coordinator's side: it takes the answers, and
// removes the region once its registration expired on the server.
func (s *regionSim) coordinate() {
	for id, cmd := range s.sent {
		r, ok := s.answers[id]
		if !ok {
			continue
		}
		delete(s.sent, id)
		if r.Error != "" {
			continue
		}
		for i, n := range cmd.Shards {
			row := s.table[n]
			switch {
			case cmd.Kind == protocol.CmdBind && row.State == protocol.StateBinding && row.Region == simRegionID:
				row.State, row.Source, row.SourceIncarnation = protocol.StateActive, "", ""
			case cmd.Kind == protocol.CmdHandOff && r.Complete && row.State == protocol.StateHandoff && row.Handoff == cmd.Handoffs[i]:
				// The new owner binds; the source diverts until released.
				row = protocol.ShardRecord{Shard: n, State: protocol.StateBinding, Region: "o", Incarnation: "o1", Handoff: row.Handoff, Source: simRegionID, SourceIncarnation: row.Incarnation}
			case cmd.Kind == protocol.CmdRelease && row.State == protocol.StateBinding && row.Source == simRegionID:
				row = protocol.ShardRecord{Shard: n, State: protocol.StateActive, Region: "o", Incarnation: "o1"}
			case cmd.Kind == protocol.CmdDrop && row.Region == simRegionID:
				row = protocol.ShardRecord{Shard: n, State: protocol.StateParked}
			}
			s.table[n] = row
		}
	}
	if s.stored != nil && !s.now.Before(s.storedAt.Add(s.ttl)) {
		// Expired on the server: the coordinator removes the region and
		// gives its shards to another.
		s.logf("coordinator: registration of %s expired; shards re-homed", s.stored.Incarnation)
		s.stored = nil
		for n, row := range s.table {
			if row.Region == simRegionID || row.Source == simRegionID {
				s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateActive, Region: "o", Incarnation: "o1"}
			}
		}
	}
}

// command makes the coordinator do one thing, at random.
func (s *regionSim) command() {
	n := s.rng.IntN(8)
	row := s.table[n]
	inc := ""
	if s.stored != nil {
		inc = s.stored.Incarnation
	}
	mine := row.Region == simRegionID && row.Incarnation == inc && inc != ""
	switch {
	case row.State == protocol.StateParked && inc != "":
		s.handoffs++
		s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateBinding, Region: simRegionID, Incarnation: inc, Handoff: s.handoffs}
		s.send(protocol.CmdBind, []int{n}, []uint64{s.handoffs})
	case row.State == protocol.StateBinding && mine:
		s.send(protocol.CmdBind, []int{n}, []uint64{row.Handoff})
	case row.State == protocol.StateActive && mine && s.rng.IntN(4) == 0:
		s.send(protocol.CmdDrop, []int{n}, []uint64{0})
	case row.State == protocol.StateActive && mine:
		s.handoffs++
		s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateHandoff, Region: simRegionID, Incarnation: inc, Handoff: s.handoffs, Source: simRegionID, SourceIncarnation: inc}
		s.send(protocol.CmdHandOff, []int{n}, []uint64{s.handoffs})
	case row.State == protocol.StateHandoff && mine && !s.connected:
		// The handoff timed out with the region out of reach: forced.
		s.logf("coordinator: handoff of %d timed out; forced to o", n)
		s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateActive, Region: "o", Incarnation: "o1"}
	case row.State == protocol.StateHandoff && mine:
		s.send(protocol.CmdHandOff, []int{n}, []uint64{row.Handoff})
	case row.State == protocol.StateBinding && row.Source == simRegionID && row.SourceIncarnation == inc:
		s.send(protocol.CmdRelease, []int{n}, []uint64{row.Handoff})
	case row.Region == "o" && row.State == protocol.StateActive:
		s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateParked} // moved off o
	case row.Region == simRegionID && !mine:
		// A row of an old incarnation: forced away (the region was fenced).
		s.table[n] = protocol.ShardRecord{Shard: n, State: protocol.StateActive, Region: "o", Incarnation: "o1"}
	}
}

// disconnect drops the connection: the process suspends the region.
func (s *regionSim) disconnect() {
	s.connected = false
	s.logf("disconnect")
	s.step(Suspended{Reason: "disconnected"})
}

func (s *regionSim) reconnect() {
	s.connected = true
	s.logf("reconnect")
	s.step(Reconnected{})
}

// check checks the guarantees that hold after every step.
func (s *regionSim) check() {
	s.t.Helper()
	for n, live := range s.live {
		if !live || s.suspended[n] {
			continue
		}
		switch {
		case !s.c.Registered():
			s.fail("shard %d served while the region is not registered", n)
		case !s.now.Before(s.c.Deadline()):
			s.fail("shard %d served at %s, past the registration deadline %s", n, s.now.Format("05.000"), s.c.Deadline().Format("05.000"))
		case s.stored == nil || s.stored.Incarnation != s.c.Incarnation() || !s.now.Before(s.storedAt.Add(s.ttl)):
			s.fail("shard %d served while the server has no registration of incarnation %s", n, s.c.Incarnation())
		}
		row := s.table[n]
		if (row.State == protocol.StateActive || row.State == protocol.StateBinding) && (row.Region != simRegionID || row.Incarnation != s.c.Incarnation()) {
			s.fail("shard %d served while the table gives it to %s/%s (%s)", n, row.Region, row.Incarnation, row.State)
		}
	}
}

// settle heals everything and checks that every suspension ended.
func (s *regionSim) settle() {
	s.t.Helper()
	s.failP = 0
	if !s.connected {
		s.reconnect()
	}
	for range 400 {
		s.deliverAll()
		s.tick(50 * time.Millisecond)
	}
	s.deliverAll()
	switch {
	case !s.c.Registered():
		s.fail("not registered after the network healed")
	case s.c.Suspended():
		s.fail("still suspended after the network healed")
	}
	for n, sus := range s.suspended {
		if sus {
			s.fail("shard %d still suspended in the data plane after the network healed", n)
		}
	}
}

// close closes the region: it unbinds everything, signals once no
// registration write is in flight, and writes nothing after.
func (s *regionSim) close() {
	s.t.Helper()
	if s.rng.IntN(2) == 0 {
		s.tick(time.Second) // a renewal in flight, most likely
	}
	quiet := make(chan struct{})
	s.step(Closing{Done: quiet})
	s.deliverAll()
	if writing, ok := s.signals[quiet]; !ok || writing {
		s.fail("closing signalled %v, with a registration write under way %v", ok, writing)
	}
	if len(s.c.Held()) != 0 || slices.Contains(slices.Collect(maps.Values(s.live)), true) {
		s.fail("a closed region holds shards")
	}
	for range 100 {
		s.tick(50 * time.Millisecond)
	}
	if len(s.pending) != 0 {
		s.fail("a closed region started I/O: %d under way", len(s.pending))
	}
}

func (s *regionSim) fail(format string, args ...any) {
	s.t.Helper()
	tail := s.log[max(0, len(s.log)-60):]
	s.t.Fatalf("%s\nlast steps:\n  %s", fmt.Sprintf(format, args...), joinLines(tail))
}

func joinLines(l []string) string {
	out := ""
	for i, x := range l {
		if i > 0 {
			out += "\n  "
		}
		out += x
	}
	return out
}

// TestRegionSim runs random histories of commands, renewals that fail or
// come late, disconnects, reconnects and ticks, checking the guarantees
// after every step, then heals the network and checks that the region
// serves again.
func TestRegionSim(t *testing.T) {
	seeds := 200
	if testing.Short() {
		seeds = 30
	}
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			s := newRegionSim(t, seed)
			s.failP = 0.2
			for range 600 {
				switch x := s.rng.IntN(100); {
				case x < 35:
					s.deliver()
				case x < 60:
					s.tick(50 * time.Millisecond)
				case x < 63:
					// The driver did not tick for a while (a slow machine).
					s.tick(time.Duration(200+s.rng.IntN(2000)) * time.Millisecond)
				case x < 88:
					s.command()
				case x < 93 && s.connected:
					s.disconnect()
				case x < 98 && !s.connected:
					s.reconnect()
				case x < 99:
					s.send(protocol.CmdProbe, nil, nil)
				case !s.c.Leaving():
					// The process starts to stop: the coordinator would move
					// the shards off; this one goes on as before.
					s.step(Leaving{})
				}
			}
			s.settle()
			s.close()
		})
	}
}
