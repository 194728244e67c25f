package region

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// world drives a Core the way the Agent's driver does, without NATS: it
// records what the core asks for, answers the way the driver would when a
// scenario says so, and checks after every step that each command is
// answered once, and that the core never serves live a shard it did not
// catch up, nor a shard it paused.
type world struct {
	t       *testing.T
	c       *Core
	now     time.Time // what Tick is told
	id      uint64
	answers map[uint64]protocol.Reply // command id -> its answer
	refused map[uint64]bool
	acts    []Action // of the last step
	live    map[int]bool
	// suspended: the shards told Suspend and not Resume, Pause or Unbind
	// since.
	suspended map[int]bool
	wasLive   map[int]bool // of the suspended shards: live (not replaying) when suspended
}

func newWorld(t *testing.T) *world {
	return &world{t: t, c: NewCore(CoreConfig{Shards: 8, HandOffWait: 5}, "inc1"), answers: map[uint64]protocol.Reply{}, refused: map[uint64]bool{}, live: map[int]bool{}, suspended: map[int]bool{}, wasLive: map[int]bool{}}
}

func (w *world) step(ev Event) []Action {
	w.t.Helper()
	w.record(w.c.Step(ev))
	return w.acts
}

func (w *world) tick() []Action {
	w.t.Helper()
	w.record(w.c.Tick(w.now))
	return w.acts
}

func (w *world) record(acts []Action) {
	w.t.Helper()
	w.acts = acts
	for _, a := range acts {
		switch a := a.(type) {
		case Answer:
			if _, dup := w.answers[a.ID]; dup {
				w.t.Fatalf("command %d answered twice: %+v", a.ID, a.Reply)
			}
			w.answers[a.ID] = a.Reply
			w.refused[a.ID] = a.Refused
		case GoLive:
			if w.live[a.Shard] {
				w.t.Fatalf("shard %d goes live twice", a.Shard)
			}
			w.live[a.Shard] = true
		case Pause:
			// A live shard, or a suspended one that a confirmation pauses
			// for a handoff started meanwhile.
			if !w.live[a.Shard] && !w.suspended[a.Shard] {
				w.t.Fatalf("shard %d paused while not live", a.Shard)
			}
			w.live[a.Shard], w.suspended[a.Shard] = false, false
		case Unbind:
			w.live[a.Shard], w.suspended[a.Shard] = false, false
		case Suspend:
			// A live shard, or a replaying one (its replay stops where it is).
			if !w.live[a.Shard] && w.c.Mode(a.Shard) != modeHold {
				w.t.Fatalf("shard %d suspended while not live nor replaying (the core has it %s)", a.Shard, w.c.Mode(a.Shard))
			}
			w.wasLive[a.Shard] = w.live[a.Shard]
			w.live[a.Shard], w.suspended[a.Shard] = false, true
		case Resume:
			if !w.suspended[a.Shard] || w.live[a.Shard] || (w.c.Mode(a.Shard) != modeLive && w.c.Mode(a.Shard) != modeHold) {
				w.t.Fatalf("shard %d resumed while not suspended, or live, or the core has it %s", a.Shard, w.c.Mode(a.Shard))
			}
			w.suspended[a.Shard] = false
			w.live[a.Shard] = w.wasLive[a.Shard] // a replaying one goes live by GoLive
		}
	}
}

// cmd sends a command and returns its id.
func (w *world) cmd(kind protocol.CommandKind, epoch uint64, shards ...int) uint64 {
	w.t.Helper()
	w.id++
	c := protocol.Command{Kind: kind, Epoch: epoch, Incarnation: w.c.incarnation, Shards: shards}
	for _, n := range shards {
		c.Handoffs = append(c.Handoffs, uint64(100+n))
	}
	w.step(CommandIn{ID: w.id, Cmd: c})
	return w.id
}

// answer returns command id's answer, failing if it has none.
func (w *world) answer(id uint64) protocol.Reply {
	w.t.Helper()
	r, ok := w.answers[id]
	if !ok {
		w.t.Fatalf("command %d not answered (last actions %s)", id, describeActions(w.acts))
	}
	return r
}

func (w *world) unanswered(id uint64) {
	w.t.Helper()
	if r, ok := w.answers[id]; ok {
		w.t.Fatalf("command %d answered too early: %+v", id, r)
	}
}

// only returns the actions of type T of the last step.
func only[T Action](acts []Action) []T {
	var out []T
	for _, a := range acts {
		if t, ok := a.(T); ok {
			out = append(out, t)
		}
	}
	return out
}

func describeActions(acts []Action) string {
	var parts []string
	for _, a := range acts {
		if _, ok := a.(Log); ok {
			continue
		}
		parts = append(parts, fmt.Sprintf("%T%+v", a, a))
	}
	return strings.Join(parts, " ")
}

// live brings shards live at epoch e, as a bind whose replays caught up.
func (w *world) bindLive(e uint64, shards ...int) {
	w.t.Helper()
	id := w.cmd(protocol.CmdBind, e, shards...)
	b := only[BindShards](w.acts)
	if len(b) != 1 {
		w.t.Fatalf("bind: %s", describeActions(w.acts))
	}
	w.step(Bound{ID: id})
	for i, n := range b[0].Shards {
		w.step(CaughtUp{Shard: n, Life: b[0].Lives[i]})
	}
}

// TestCoreEpochs (docs/PROTOCOL.md, "Epochs and fencing": "every message
// carries the coordinator epoch"): a newer epoch is checked against the lease
// before any command is obeyed, commands wait behind the check in order, a
// forged epoch is refused and changes nothing, and a stale epoch is refused at
// once.
func TestCoreEpochs(t *testing.T) {
	w := newWorld(t)
	probe := w.cmd(protocol.CmdProbe, 3)
	if c := only[CheckEpoch](w.acts); len(c) != 1 || c[0].Epoch != 3 {
		t.Fatalf("epoch 3 not checked: %s", describeActions(w.acts))
	}
	bind := w.cmd(protocol.CmdBind, 3, 1) // waits behind the check
	w.unanswered(probe)
	w.unanswered(bind)
	w.step(EpochChecked{Epoch: 3})
	if r := w.answer(probe); r.Error != "" || r.Epoch != 3 {
		t.Fatalf("probe after the check: %+v", r)
	}
	if b := only[BindShards](w.acts); len(b) != 1 || !slices.Equal(b[0].Shards, []int{1}) {
		t.Fatalf("bind after the check: %s", describeActions(w.acts))
	}
	// A forged epoch: refused, and the real coordinator's commands are not
	// made stale.
	forged := w.cmd(protocol.CmdDrop, 1000, 1)
	after := w.cmd(protocol.CmdDrop, 1000, 1)
	w.step(EpochChecked{Epoch: 1000, Err: errors.New("epoch 1000 is not the coordinator lease's (3)")})
	for _, id := range []uint64{forged, after} {
		if r := w.answer(id); !strings.Contains(r.Error, "not the coordinator lease's") || r.Epoch != 3 || !w.refused[id] {
			t.Fatalf("forged epoch: %+v", r)
		}
	}
	if len(only[Unbind](w.acts)) != 0 {
		t.Fatal("a forged drop unbound a shard")
	}
	// A stale epoch is refused without a check.
	stale := w.cmd(protocol.CmdDrop, 2, 1)
	if r := w.answer(stale); !strings.Contains(r.Error, "stale epoch 2") || len(only[CheckEpoch](w.acts)) != 0 {
		t.Fatalf("stale epoch: %+v, %s", r, describeActions(w.acts))
	}
	// Another incarnation's command is refused.
	w.id++
	w.step(CommandIn{ID: w.id, Cmd: protocol.Command{Kind: protocol.CmdDrop, Epoch: 3, Incarnation: "inc0", Shards: []int{1}}})
	if r := w.answer(w.id); !strings.Contains(r.Error, "incarnation") || r.Incarnation != "inc1" {
		t.Fatalf("other incarnation: %+v", r)
	}
	// A malformed command is refused.
	w.id++
	w.step(CommandIn{ID: w.id, Err: errors.New("malformed")})
	if !w.refused[w.id] {
		t.Fatal("malformed command not refused")
	}
}

// TestCoreBind (docs/PROTOCOL.md, "Handoff", step 4): a bind subscribes the
// shards not held yet and is answered once the subscriptions are flushed; each
// shard goes live when its replay caught up; a shard bound again is left as it
// is; a shard paused here is not bound; shards that failed to bind are
// forgotten.
func TestCoreBind(t *testing.T) {
	w := newWorld(t)
	w.step(EpochChecked{Epoch: 1}) // nothing waits: ignored
	w.c.maxEpoch = 1
	id := w.cmd(protocol.CmdBind, 1, 1, 2)
	b := only[BindShards](w.acts)
	if len(b) != 1 || !slices.Equal(b[0].Shards, []int{1, 2}) || !slices.Equal(b[0].Handoffs, []uint64{101, 102}) {
		t.Fatalf("bind: %s", describeActions(w.acts))
	}
	w.unanswered(id)
	w.step(Bound{ID: id})
	if r := w.answer(id); r.Error != "" || !slices.Equal(r.Held, []int{1, 2}) {
		t.Fatalf("bound: %+v", r)
	}
	if w.c.Mode(1) != modeHold {
		t.Fatalf("shard 1 %s before its replay caught up", w.c.Mode(1))
	}
	w.step(CaughtUp{Shard: 1, Life: b[0].Lives[0]})
	if g := only[GoLive](w.acts); len(g) != 1 || g[0].Shard != 1 || w.c.Mode(1) != modeLive {
		t.Fatalf("caught up: %s", describeActions(w.acts))
	}
	// A bind of held shards subscribes nothing and is answered at once,
	// naming those served live (1; 2 still replays): a coordinator that
	// parked them meanwhile discards what it diverted.
	again := w.cmd(protocol.CmdBind, 1, 1, 2)
	if r := w.answer(again); r.Error != "" || len(only[BindShards](w.acts)) != 0 || !slices.Equal(r.Live, []int{1}) {
		t.Fatalf("bind again: %+v %s", r, describeActions(w.acts))
	}
	// A stale catch-up (of an earlier life) changes nothing.
	w.step(CaughtUp{Shard: 2, Life: 99})
	if w.c.Mode(2) != modeHold {
		t.Fatal("a catch-up of another life made shard 2 live")
	}
	// Failures: the shards that failed are forgotten, the others held.
	id = w.cmd(protocol.CmdBind, 1, 3, 4)
	w.step(Bound{ID: id, Failed: []int{4}, Err: errors.New("subscribe shard 4: permissions")})
	if r := w.answer(id); !strings.Contains(r.Error, "permissions") || !slices.Equal(r.Held, []int{1, 2, 3}) {
		t.Fatalf("failed bind: %+v", r)
	}
	// A paused shard is not bound again: the whole bind is refused.
	w.step(CaughtUp{Shard: 2, Life: b[0].Lives[1]})
	w.cmd(protocol.CmdHandOff, 1, 2)
	id = w.cmd(protocol.CmdBind, 1, 2, 5)
	if r := w.answer(id); !strings.Contains(r.Error, "paused for a handoff") || len(only[BindShards](w.acts)) != 0 {
		t.Fatalf("bind of a paused shard: %+v", r)
	}
}

// TestCoreHandOff (docs/PROTOCOL.md, "Handoff", step 2): the owner pauses a
// live shard (diverts it, stops its entities) and says Complete once its
// entities stopped, or not after HandOffWait; a replaying shard is reported
// and not paused; a repeated HandOff pauses nothing again; a stop reported for
// an earlier life of the shard does not complete it.
func TestCoreHandOff(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 1, 2)
	id := w.cmd(protocol.CmdHandOff, 1, 1)
	p := only[Pause](w.acts)
	if len(p) != 1 || p[0].Shard != 1 || p[0].Handoff != 101 || w.c.Mode(1) != modeDivert {
		t.Fatalf("handoff: %s", describeActions(w.acts))
	}
	w.unanswered(id)
	again := w.cmd(protocol.CmdHandOff, 1, 1)
	if len(only[Pause](w.acts)) != 0 {
		t.Fatal("a repeated handoff paused again")
	}
	w.step(EntitiesStopped{Shard: 1, Life: p[0].Life - 1}) // an earlier life
	w.unanswered(id)
	w.step(EntitiesStopped{Shard: 1, Life: p[0].Life})
	for _, i := range []uint64{id, again} {
		if r := w.answer(i); !r.Complete || r.Error != "" {
			t.Fatalf("handoff %d after the stop: %+v", i, r)
		}
	}
	// Stopped already: Complete at once.
	if r := w.answer(w.cmd(protocol.CmdHandOff, 1, 1)); !r.Complete {
		t.Fatalf("handoff of a stopped shard: %+v", r)
	}
	// Entities that do not stop: not Complete after HandOffWait ticks.
	id = w.cmd(protocol.CmdHandOff, 1, 2)
	for range 4 {
		w.tick()
	}
	w.unanswered(id)
	w.tick()
	if r := w.answer(id); r.Complete || r.Error != "" {
		t.Fatalf("handoff timed out: %+v", r)
	}
	// A replaying shard.
	bind := w.cmd(protocol.CmdBind, 1, 3)
	w.step(Bound{ID: bind})
	id = w.cmd(protocol.CmdHandOff, 1, 3)
	if r := w.answer(id); r.Complete || !slices.Equal(r.Replaying, []int{3}) || w.c.Mode(3) != modeHold {
		t.Fatalf("handoff of a replaying shard: %+v", r)
	}
}

// TestCoreRelease (docs/PROTOCOL.md, "Handoff", step 5): the source releases
// only what it paused; a release drains and marks each shard (a shard not held
// gets its marker all the same), a repeated release joins the one under way,
// and the answer comes when all are done, with their errors.
func TestCoreRelease(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 1, 2, 3)
	if r := w.answer(w.cmd(protocol.CmdRelease, 1, 1)); !strings.Contains(r.Error, "live here") {
		t.Fatalf("release of a live shard: %+v", r)
	}
	w.cmd(protocol.CmdHandOff, 1, 1, 2)
	id := w.cmd(protocol.CmdRelease, 1, 1, 2, 7)
	rel := only[Release](w.acts)
	if len(rel) != 3 || !rel[0].Held || !rel[1].Held || rel[2].Held || rel[2].Shard != 7 {
		t.Fatalf("release: %s", describeActions(w.acts))
	}
	again := w.cmd(protocol.CmdRelease, 1, 1)
	if len(only[Release](w.acts)) != 0 {
		t.Fatal("a repeated release released again")
	}
	w.step(ReleaseDone{Token: rel[0].Token})
	if r := w.answer(again); r.Error != "" || slices.Contains(r.Held, 1) {
		t.Fatalf("joined release: %+v", r)
	}
	w.unanswered(id)
	w.step(ReleaseDone{Token: rel[1].Token, Err: errors.New("end marker of shard 2: timeout")})
	w.unanswered(id)
	w.step(ReleaseDone{Token: rel[2].Token})
	if r := w.answer(id); !strings.Contains(r.Error, "timeout") || !slices.Equal(r.Held, []int{3}) {
		t.Fatalf("release answered: %+v", r)
	}
}

// TestCoreFence (docs/PROTOCOL.md, "Epochs and fencing": self-fencing): a
// fenced region stops serving every shard at once, fails what waited, refuses
// every command until it registered a new incarnation, which holds nothing.
func TestCoreFence(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 1, 2)
	handoff := w.cmd(protocol.CmdHandOff, 1, 1)
	w.step(Fenced{Reason: "disconnected from NATS"})
	if u := only[Unbind](w.acts); len(u) != 2 {
		t.Fatalf("fence: %s", describeActions(w.acts))
	}
	if r := w.answer(handoff); r.Error == "" {
		t.Fatalf("handoff waiting when fenced: %+v", r)
	}
	if r := w.answer(w.cmd(protocol.CmdBind, 1, 3)); !strings.Contains(r.Error, errNotRegistered.Error()) || len(only[BindShards](w.acts)) != 0 {
		t.Fatalf("bind while fenced: %+v", r)
	}
	w.step(Fenced{Reason: "again"})
	if len(w.acts) != 0 {
		t.Fatalf("a second fence did something: %s", describeActions(w.acts))
	}
	// The next tick registers a new incarnation.
	w.c.cfg.LeaseTTL, w.c.cfg.NewIncarnation = 4*time.Second, func() string { return "inc2" }
	reg := only[Register](w.tick())
	if len(reg) != 1 || reg[0].Info.Incarnation != "inc2" {
		t.Fatalf("tick after the fence: %s", describeActions(w.acts))
	}
	w.step(RegisterDone{Token: reg[0].Token, Sent: w.now, At: w.now})
	if r := w.answer(w.cmd(protocol.CmdProbe, 1)); r.Error != "" || r.Incarnation != "inc2" || len(r.Held) != 0 {
		t.Fatalf("probe of the new incarnation: %+v", r)
	}
}

// rows are shard table rows that give shards to the world's region
// ("inc1", the core knows no region id), in state st.
func rows(st protocol.ShardState, shards ...int) []protocol.ShardRecord {
	var out []protocol.ShardRecord
	for _, n := range shards {
		r := protocol.ShardRecord{Shard: n, State: st, Region: "r", Incarnation: "inc1", Handoff: uint64(100 + n)}
		if st == protocol.StateHandoff {
			r.Source, r.SourceIncarnation = "r", "inc1"
		}
		out = append(out, r)
	}
	return out
}

// TestCoreSuspend (issue 17, ride-through of a NATS server loss; issue
// 30 B): when the connection drops, no shard is dropped: live shards are
// suspended (held), replaying ones stop where they are, paused ones go
// on diverting; until the region confirmed its shards it answers probes
// and drops and refuses every other command; the confirmation resumes
// the suspended shards the table still gives it and drops the others. A
// fence during a suspension drops everything.
func TestCoreSuspend(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 1, 2, 4, 5)
	handoff := w.cmd(protocol.CmdHandOff, 1, 2) // 2 pauses, waits for its entities
	bind := w.cmd(protocol.CmdBind, 1, 3)       // 3 replays its buffer
	w.step(Suspended{Incarnation: "other"})
	if len(w.acts) != 0 {
		t.Fatalf("a suspension of another incarnation did something: %s", describeActions(w.acts))
	}
	w.step(Suspended{Incarnation: "inc1"})
	suspended := func() (out []int) {
		for _, a := range only[Suspend](w.acts) {
			out = append(out, a.Shard)
		}
		return out
	}()
	if !slices.Equal(suspended, []int{1, 3, 4, 5}) || len(only[Unbind](w.acts)) != 0 {
		t.Fatalf("suspend: suspended %v: %s", suspended, describeActions(w.acts))
	}
	if w.c.Mode(2) != modeDivert || w.c.Mode(3) != modeHold {
		t.Fatalf("suspend: shard 2 %s, shard 3 %s; want them paused and replaying", w.c.Mode(2), w.c.Mode(3))
	}
	if w.answer(handoff).Error == "" || w.answer(bind).Error == "" {
		t.Fatalf("the handoff and the bind under way were not failed: %+v %+v", w.answer(handoff), w.answer(bind))
	}
	for _, kind := range []protocol.CommandKind{protocol.CmdBind, protocol.CmdHandOff, protocol.CmdRelease, protocol.CmdLeave} {
		id := w.cmd(kind, 1, 6)
		if r := w.answer(id); !strings.Contains(r.Error, errSuspended.Error()) || !w.refused[id] {
			t.Fatalf("%s while suspended: %+v", kind, r)
		}
		if len(only[BindShards](w.acts))+len(only[Pause](w.acts))+len(only[Release](w.acts))+len(only[Renew](w.acts)) != 0 {
			t.Fatalf("%s while suspended did something: %s", kind, describeActions(w.acts))
		}
	}
	if r := w.answer(w.cmd(protocol.CmdProbe, 1)); r.Error != "" || !slices.Equal(r.Held, []int{1, 2, 3, 4, 5}) {
		t.Fatalf("probe while suspended: %+v", r)
	}
	if r := w.answer(w.cmd(protocol.CmdDrop, 1, 5)); r.Error != "" || !slices.Equal(r.Held, []int{1, 2, 3, 4}) {
		t.Fatalf("drop while suspended: %+v", r)
	}
	// 1 is still active here, 2 still handing off from here, 3 still
	// binding here; 4 was given to another region meanwhile.
	table := slices.Concat(rows(protocol.StateActive, 1), rows(protocol.StateHandoff, 2), rows(protocol.StateBinding, 3, 7),
		[]protocol.ShardRecord{{Shard: 4, State: protocol.StateBinding, Region: "r2", Incarnation: "x", Handoff: 9}})
	w.step(Confirmed{Incarnation: "inc1", Drops: w.c.reg.drops, Rows: table})
	resumed := only[Resume](w.acts)
	if len(resumed) != 2 || resumed[0].Shard != 1 || resumed[1].Shard != 3 {
		t.Fatalf("confirm: %s", describeActions(w.acts))
	}
	if u := only[Unbind](w.acts); len(u) != 1 || u[0].Shard != 4 {
		t.Fatalf("confirm: %s", describeActions(w.acts))
	}
	if w.c.Mode(1) != modeLive || w.c.Mode(2) != modeDivert || w.c.Mode(3) != modeHold {
		t.Fatalf("after the confirmation: 1 %s, 2 %s, 3 %s", w.c.Mode(1), w.c.Mode(2), w.c.Mode(3))
	}
	w.step(Confirmed{Incarnation: "inc1", Drops: w.c.reg.drops, Rows: table})
	if len(w.acts) != 0 {
		t.Fatalf("a second confirmation did something: %s", describeActions(w.acts))
	}
	if w.cmd(protocol.CmdBind, 1, 6); len(only[BindShards](w.acts)) != 1 {
		t.Fatalf("bind after the confirmation: %s", describeActions(w.acts))
	}

	w.step(Suspended{Incarnation: "inc1"})
	w.step(Fenced{Reason: "registration lost"})
	if u := only[Unbind](w.acts); len(u) != 4 {
		t.Fatalf("fence while suspended: %s", describeActions(w.acts))
	}
	w.step(Confirmed{Incarnation: "inc1", Drops: w.c.reg.drops, Rows: rows(protocol.StateActive, 1)})
	if len(w.acts) != 0 {
		t.Fatalf("a confirmation after the fence did something: %s", describeActions(w.acts))
	}
}

// TestCoreReplayRidesThroughDisconnect (issue 30 B, PROTOCOL.md "Riding
// through a lost connection"): a shard replaying its buffer when the
// connection drops keeps its replay: a marker reached while suspended
// does not make it live; once the table confirms it (the coordinator
// wrote it active meanwhile, the source having released it), it goes
// live; a bind of it again (the coordinator asks again) starts no second
// replay, which would deliver the buffer's messages again with an empty
// seen-set.
func TestCoreReplayRidesThroughDisconnect(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	bind := w.cmd(protocol.CmdBind, 1, 3)
	b := only[BindShards](w.acts)[0]
	w.step(Bound{ID: bind})
	w.step(Suspended{Incarnation: "inc1"})
	if s := only[Suspend](w.acts); len(s) != 1 || s[0].Shard != 3 || len(only[Unbind](w.acts)) != 0 {
		t.Fatalf("suspend: %s", describeActions(w.acts))
	}
	w.step(CaughtUp{Shard: 3, Life: b.Lives[0]})
	if len(only[GoLive](w.acts)) != 0 || w.c.Mode(3) != modeHold {
		t.Fatalf("a shard went live while suspended: %s", describeActions(w.acts))
	}
	w.step(Confirmed{Incarnation: "inc1", Drops: w.c.reg.drops, Rows: rows(protocol.StateActive, 3)})
	if r, g := only[Resume](w.acts), only[GoLive](w.acts); len(r) != 1 || len(g) != 1 || w.c.Mode(3) != modeLive {
		t.Fatalf("confirm: %s", describeActions(w.acts))
	}
	again := w.cmd(protocol.CmdBind, 1, 3)
	if len(only[BindShards](w.acts)) != 0 {
		t.Fatalf("a bind of a shard live here started a replay: %s", describeActions(w.acts))
	}
	if r := w.answer(again); r.Error != "" || !slices.Equal(r.Live, []int{3}) {
		t.Fatalf("bind again: %+v", r)
	}

	// Suspended again while replaying, and this time the replay is still
	// under way at the confirmation: it goes on, and a bind of it again
	// starts nothing (answered bound, not live).
	bind = w.cmd(protocol.CmdBind, 1, 5)
	b = only[BindShards](w.acts)[0]
	w.step(Bound{ID: bind})
	w.step(Suspended{Incarnation: "inc1"})
	w.step(Confirmed{Incarnation: "inc1", Drops: w.c.reg.drops, Rows: slices.Concat(rows(protocol.StateActive, 3), rows(protocol.StateBinding, 5))})
	if r := only[Resume](w.acts); len(r) != 2 || len(only[GoLive](w.acts)) != 0 || w.c.Mode(5) != modeHold {
		t.Fatalf("confirm: %s", describeActions(w.acts))
	}
	again = w.cmd(protocol.CmdBind, 1, 5)
	if r := w.answer(again); len(only[BindShards](w.acts)) != 0 || r.Error != "" || len(r.Live) != 0 || !slices.Contains(r.Held, 5) {
		t.Fatalf("bind again while replaying: %+v %s", r, describeActions(w.acts))
	}
	w.step(CaughtUp{Shard: 5, Life: b.Lives[0]})
	if g := only[GoLive](w.acts); len(g) != 1 {
		t.Fatalf("caught up: %s", describeActions(w.acts))
	}
}

// TestCoreConfirmPausesHandoff (issue 30 C): a live shard whose row was
// written handoff (from this region) while the region was suspended is
// paused for that handoff at the confirmation, as the refused handoff
// command would have done: what it held goes to the buffer, and the
// coordinator's next handoff command finds it paused and completes.
func TestCoreConfirmPausesHandoff(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 2)
	life := w.c.shards[2].life
	w.step(Suspended{Incarnation: "inc1"})
	refused := w.cmd(protocol.CmdHandOff, 1, 2)
	if r := w.answer(refused); !strings.Contains(r.Error, errSuspended.Error()) {
		t.Fatalf("handoff while suspended: %+v", r)
	}
	w.step(Confirmed{Incarnation: "inc1", Drops: w.c.reg.drops, Rows: rows(protocol.StateHandoff, 2)})
	p := only[Pause](w.acts)
	if len(p) != 1 || p[0].Shard != 2 || p[0].Handoff != 102 || p[0].Life != life || len(only[Unbind](w.acts)) != 0 {
		t.Fatalf("confirm: %s", describeActions(w.acts))
	}
	w.step(EntitiesStopped{Shard: 2, Life: life})
	if r := w.answer(w.cmd(protocol.CmdHandOff, 1, 2)); r.Error != "" || !r.Complete {
		t.Fatalf("handoff asked again: %+v", r)
	}
}

// TestCoreConfirmVerdicts: what a confirmation does with each kind of
// suspended shard for each row (PROTOCOL.md, Riding through a lost
// connection, has the table).
func TestCoreConfirmVerdicts(t *testing.T) {
	const me, inc = "r", "inc1"
	row := func(st protocol.ShardState, region, rinc, src, srcInc string) protocol.ShardRecord {
		return protocol.ShardRecord{Shard: 1, State: st, Region: region, Incarnation: rinc, Source: src, SourceIncarnation: srcInc, Handoff: 7}
	}
	rowsByName := map[string]protocol.ShardRecord{
		"none":                {},
		"parked":              row(protocol.StateParked, "", "", "", ""),
		"active here":         row(protocol.StateActive, me, inc, "", ""),
		"active elsewhere":    row(protocol.StateActive, "r2", "x", "", ""),
		"active, old inc":     row(protocol.StateActive, me, "inc0", "", ""),
		"binding here":        row(protocol.StateBinding, me, inc, "r2", "x"),
		"binding from here":   row(protocol.StateBinding, "r2", "x", me, inc),
		"binding elsewhere":   row(protocol.StateBinding, "r2", "x", "", ""),
		"handoff from here":   row(protocol.StateHandoff, me, inc, me, inc),
		"handoff elsewhere":   row(protocol.StateHandoff, "r2", "x", "r2", "x"),
		"handoff, old inc":    row(protocol.StateHandoff, me, "inc0", me, "inc0"),
		"binding, other name": row(protocol.StateBinding, "r9", inc, "", ""),
	}
	want := map[mode]map[string]verdict{
		modeSuspended: {"active here": keepShard, "binding here": keepShard, "handoff from here": pauseShard, "binding from here": pauseShard},
		modeHold:      {"active here": keepShard, "binding here": keepShard, "handoff from here": keepShard},
		modeDivert:    {"handoff from here": keepShard, "binding from here": keepShard},
	}
	c := NewCore(CoreConfig{Shards: 8, Region: me}, inc)
	for m, keep := range want {
		for name, r := range rowsByName {
			got := c.confirmVerdict(&coreShard{mode: m, suspended: m != modeSuspended}, r)
			exp, ok := keep[name]
			if !ok {
				exp = dropShard
			}
			if got != exp {
				t.Errorf("%s shard, row %s: verdict %d, want %d", m, name, got, exp)
			}
		}
	}
	if v := c.confirmVerdict(&coreShard{mode: modeDivert, suspended: true, releasing: 3}, rowsByName["parked"]); v != keepShard {
		t.Errorf("a paused shard whose release is under way: verdict %d, want it kept (the release ends it)", v)
	}
}

// TestCoreDrop (docs/PROTOCOL.md, "Handoff": forced reallocation): a drop
// unbinds the shards at once whatever their mode; dropping a shard not held is
// a no-op.
func TestCoreDrop(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 1)
	w.cmd(protocol.CmdHandOff, 1, 1)
	bind := w.cmd(protocol.CmdBind, 1, 2)
	w.step(Bound{ID: bind})
	id := w.cmd(protocol.CmdDrop, 1, 1, 2, 3)
	if u := only[Unbind](w.acts); len(u) != 2 || u[0].Shard != 1 || u[1].Shard != 2 {
		t.Fatalf("drop: %s", describeActions(w.acts))
	}
	if r := w.answer(id); len(r.Held) != 0 {
		t.Fatalf("drop answered: %+v", r)
	}
}

// TestCoreLeave (docs/PROTOCOL.md, "Rebalance and leaving"; shardctl drain and
// undrain): a leave writes the mark and is answered once it is written; an
// undrain is refused while shards are held and for a stopping process.
func TestCoreLeave(t *testing.T) {
	w := newWorld(t)
	w.c.maxEpoch = 1
	id := w.cmd(protocol.CmdLeave, 1)
	wr := only[Renew](w.acts)
	if len(wr) != 1 || !wr[0].Info.Leaving || !w.c.Leaving() {
		t.Fatalf("leave: %s", describeActions(w.acts))
	}
	w.unanswered(id)
	w.step(RenewDone{Token: wr[0].Token})
	if r := w.answer(id); r.Error != "" {
		t.Fatalf("leave answered: %+v", r)
	}
	w.bindLive(1, 1)
	if r := w.answer(w.cmd(protocol.CmdUndrain, 1)); !strings.Contains(r.Error, "still holds shards [1]") || !w.c.Leaving() {
		t.Fatalf("undrain while holding: %+v", r)
	}
	w.cmd(protocol.CmdDrop, 1, 1)
	id = w.cmd(protocol.CmdUndrain, 1)
	wr = only[Renew](w.acts)
	if len(wr) != 1 || wr[0].Info.Leaving {
		t.Fatalf("undrain: %s", describeActions(w.acts))
	}
	w.step(RenewDone{Token: wr[0].Token, Err: errors.New("timeout")})
	if r := w.answer(id); !strings.Contains(r.Error, "timeout") || w.c.Leaving() {
		t.Fatalf("undrain: %+v", r)
	}
	w.step(Leaving{})
	if !w.c.Leaving() {
		t.Fatal("Leaving did not mark the region leaving")
	}
	if r := w.answer(w.cmd(protocol.CmdUndrain, 1)); !strings.Contains(r.Error, "process is stopping") {
		t.Fatalf("undrain of a stopping process: %+v", r)
	}
	w.step(Closing{})
	if r := w.answer(w.cmd(protocol.CmdProbe, 1)); !strings.Contains(r.Error, "closing") {
		t.Fatalf("probe of a closing region: %+v", r)
	}
}
