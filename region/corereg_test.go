package region

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// The registration life cycle of the core (corereg.go), case by case.
// Time is the world's: the ttl is 4 s, so a renewal is due 1 s after the
// last one was sent and the deadline is 3 s after it.

const regTTL = 4 * time.Second

// newRegWorld returns a world whose core opened (registered "inc1" at the
// world's time zero) with a registration life cycle of its own.
func newRegWorld(t *testing.T) *world {
	t.Helper()
	w := newWorld(t)
	w.now = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	incs := 0
	w.c = NewCore(CoreConfig{Shards: 8, HandOffWait: 5, Region: "r", LeaseTTL: regTTL, NewIncarnation: func() string {
		incs++
		return fmt.Sprintf("inc%d", incs)
	}}, "")
	w.record(w.c.Start(w.now))
	reg := only[Register](w.acts)
	if len(reg) != 1 || reg[0].CheckTakeover || reg[0].Info.Incarnation != "inc1" {
		t.Fatalf("start: %s", describeActions(w.acts))
	}
	w.step(RegisterDone{Token: reg[0].Token, Lease: kvstate.Lease{Revision: 1}, Sent: w.now, At: w.now})
	if o := only[Opened](w.acts); len(o) != 1 || o[0].Err != nil || !w.c.Registered() {
		t.Fatalf("open: %s", describeActions(w.acts))
	}
	return w
}

// tickTo ticks every 50 ms until the world's time is at, and returns
// every action of those ticks.
func (w *world) tickTo(at time.Time) []Action {
	w.t.Helper()
	var all []Action
	for w.now.Before(at) {
		w.now = w.now.Add(50 * time.Millisecond)
		all = append(all, w.tick()...)
	}
	w.acts = all
	return all
}

// renewal returns the one Renew action of the last steps.
func (w *world) renewal() Renew {
	w.t.Helper()
	r := only[Renew](w.acts)
	if len(r) != 1 {
		w.t.Fatalf("want one renewal: %s", describeActions(w.acts))
	}
	return r[0]
}

func counted(acts []Action, what counter) int {
	n := 0
	for _, c := range only[Count](acts) {
		if c.What == what {
			n++
		}
	}
	return n
}

// TestCoreRenewal (docs/PROTOCOL.md, "Epochs and fencing": self-fencing): the
// registration is renewed every ttl/4 (at most 1 s) after the last renewal was
// sent; a failed renewal is tried again 250 ms later; when none succeeded for
// 3/4 of the ttl the region fences, registers a new incarnation (checking that
// no other process took its id over), and starts it with no shard.
func TestCoreRenewal(t *testing.T) {
	w := newRegWorld(t)
	t0 := w.now
	w.c.maxEpoch = 1
	w.bindLive(1, 1, 2)
	if len(w.tickTo(t0.Add(950*time.Millisecond))) != 0 {
		t.Fatalf("a renewal before it was due: %s", describeActions(w.acts))
	}
	w.tickTo(t0.Add(time.Second))
	r := w.renewal()
	if r.Info.Incarnation != "inc1" || r.Lease.Revision != 1 || !r.Deadline.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("renewal %+v", r)
	}
	w.step(RenewDone{Token: r.Token, Lease: kvstate.Lease{Revision: 2}, Sent: w.now, At: w.now.Add(20 * time.Millisecond)})
	if !w.c.Deadline().Equal(t0.Add(time.Second + 3*regTTL/4)) {
		t.Fatalf("deadline %s after a renewal sent at 1 s", w.c.Deadline().Sub(t0))
	}
	// From now on every renewal fails, 250 ms after the last.
	last := t0.Add(time.Second)
	for w.tickTo(last.Add(time.Second)); ; {
		r := w.renewal()
		w.step(RenewDone{Token: r.Token, Sent: w.now, At: w.now, Err: errors.New("no stream leader")})
		if !w.c.Registered() {
			t.Fatalf("fenced at %s by a failure before the deadline", w.now.Sub(t0))
		}
		if counted(w.acts, countRenewalFailed) != 1 {
			t.Fatalf("failure not counted: %s", describeActions(w.acts))
		}
		if !w.now.Add(250 * time.Millisecond).Before(w.c.Deadline()) {
			break
		}
		w.tickTo(w.now.Add(250 * time.Millisecond))
	}
	w.tickTo(w.c.Deadline())
	if u := only[Unbind](w.acts); len(u) != 2 || w.c.Registered() || counted(w.acts, countFenced) != 1 {
		t.Fatalf("at the deadline: %s", describeActions(w.acts))
	}
	w.tickTo(w.now.Add(50 * time.Millisecond))
	reg := only[Register](w.acts)
	if len(reg) != 1 || !reg[0].CheckTakeover || reg[0].Info.Incarnation != "inc2" {
		t.Fatalf("after the fence: %s", describeActions(w.acts))
	}
	w.step(RegisterDone{Token: reg[0].Token, Lease: kvstate.Lease{Revision: 9}, Sent: w.now, At: w.now})
	if !w.c.Registered() || w.c.Incarnation() != "inc2" || len(w.c.Held()) != 0 {
		t.Fatalf("new incarnation: registered %v %s holding %v", w.c.Registered(), w.c.Incarnation(), w.c.Held())
	}
}

// TestCoreRenewalConflict: a renewal refused because the registration is no
// longer the one renewed (the coordinator removed the region, or another
// process took the id over) fences the region at once.
func TestCoreRenewalConflict(t *testing.T) {
	w := newRegWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 3)
	w.tickTo(w.now.Add(time.Second))
	r := w.renewal()
	w.step(RenewDone{Token: r.Token, Sent: w.now, At: w.now, Err: kvstate.ErrConflict, Conflict: true})
	if u := only[Unbind](w.acts); len(u) != 1 || w.c.Registered() {
		t.Fatalf("conflict: %s", describeActions(w.acts))
	}
}

// TestCoreLateAcknowledgement: a registration acknowledged after its own
// deadline counts as expired: it is written again as the same incarnation
// (a late write of it may still be stored); the first registration gives up
// after three.
func TestCoreLateAcknowledgement(t *testing.T) {
	w := newWorld(t)
	w.now = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	w.c = NewCore(CoreConfig{Shards: 8, Region: "r", LeaseTTL: regTTL, NewIncarnation: func() string { return "once" }}, "")
	w.record(w.c.Start(w.now))
	for try := 1; try <= maxLateAcks; try++ {
		reg := only[Register](w.acts)
		if len(reg) != 1 || reg[0].Info.Incarnation != "once" {
			t.Fatalf("try %d: %s", try, describeActions(w.acts))
		}
		w.step(RegisterDone{Token: reg[0].Token, Sent: w.now, At: w.now.Add(3 * regTTL / 4)})
		w.now = w.now.Add(3 * regTTL / 4)
		if w.c.Registered() {
			t.Fatal("registered by a late acknowledgement")
		}
	}
	if o := only[Opened](w.acts); len(o) != 1 || !errors.Is(o[0].Err, errLateAck) {
		t.Fatalf("after %d late acknowledgements: %s", maxLateAcks, describeActions(w.acts))
	}
	if w.tickTo(w.now.Add(2 * time.Second)); len(only[Register](w.acts)) != 0 {
		t.Fatalf("registered again after giving up: %s", describeActions(w.acts))
	}
}

// TestCoreDeadlineWithRenewalInFlight: when the deadline passes while a
// renewal is still unanswered, the region serves nothing (suspended) until it
// knows: a success is followed by a confirmation of the shards, as after a
// stall; a failure fences.
func TestCoreDeadlineWithRenewalInFlight(t *testing.T) {
	w := newRegWorld(t)
	t0 := w.now
	w.c.maxEpoch = 1
	w.bindLive(1, 1, 2)
	w.tickTo(t0.Add(time.Second))
	slow := w.renewal()
	w.tickTo(t0.Add(3 * regTTL / 4))
	if s := only[Suspend](w.acts); len(s) != 2 || !w.c.Suspended() || !w.c.Registered() || len(only[Renew](w.acts)) != 0 {
		t.Fatalf("at the deadline with a renewal in flight: %s", describeActions(w.acts))
	}
	// The renewal went through after all: the confirmation renews again,
	// then reads the table.
	w.step(RenewDone{Token: slow.Token, Lease: kvstate.Lease{Revision: 2}, Sent: t0.Add(time.Second), At: w.now})
	r := w.renewal()
	w.step(RenewDone{Token: r.Token, Lease: kvstate.Lease{Revision: 3}, Sent: w.now, At: w.now})
	rt := only[ReadTable](w.acts)
	if len(rt) != 1 {
		t.Fatalf("after the renewals: %s", describeActions(w.acts))
	}
	w.step(Confirmed{Incarnation: rt[0].Incarnation, Drops: rt[0].Drops, Rows: rows(protocol.StateActive, 1)})
	if res, u := only[Resume](w.acts), only[Unbind](w.acts); len(res) != 1 || res[0].Shard != 1 || len(u) != 1 || u[0].Shard != 2 || w.c.Suspended() {
		t.Fatalf("confirmation: %s", describeActions(w.acts))
	}

	// Once more, and this time the renewal fails: fenced.
	w.tickTo(w.now.Add(time.Second))
	slow = w.renewal()
	w.tickTo(w.c.Deadline())
	if !w.c.Suspended() {
		t.Fatalf("not suspended at the deadline: %s", describeActions(w.acts))
	}
	w.step(RenewDone{Token: slow.Token, Sent: w.now.Add(-2 * time.Second), At: w.now, Err: errors.New("context deadline exceeded")})
	if u := only[Unbind](w.acts); len(u) != 1 || w.c.Registered() {
		t.Fatalf("renewal failed past the deadline: %s", describeActions(w.acts))
	}
}

// TestCoreConfirmation (issue 17, ride-through of a NATS server loss): back
// on NATS, a suspended region renews its registration, then reads the table;
// a confirmation that another drop overtook is made again; one that fails is
// retried with a backoff; the shards are served again only once confirmed.
func TestCoreConfirmation(t *testing.T) {
	w := newRegWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 1)
	w.step(Suspended{Reason: "disconnected"})
	if len(only[Suspend](w.acts)) != 1 || counted(w.acts, countSuspended) != 1 {
		t.Fatalf("suspend: %s", describeActions(w.acts))
	}
	w.step(Reconnected{})
	r := w.renewal()
	w.step(RenewDone{Token: r.Token, Lease: kvstate.Lease{Revision: 2}, Sent: w.now, At: w.now})
	rt := only[ReadTable](w.acts)
	if len(rt) != 1 || rt[0].Drops != 1 {
		t.Fatalf("after the renewal: %s", describeActions(w.acts))
	}
	// Dropped again while the table is read: that read proves nothing.
	w.step(Suspended{Reason: "disconnected"})
	if len(w.acts) != 0 {
		t.Fatalf("a second drop while suspended: %s", describeActions(w.acts))
	}
	w.step(Confirmed{Incarnation: "inc1", Drops: rt[0].Drops, Rows: rows(protocol.StateActive, 1)})
	if len(only[Resume](w.acts)) != 0 || !w.c.Suspended() {
		t.Fatalf("a confirmation overtaken by a drop: %s", describeActions(w.acts))
	}
	// The next round, 100 ms later; its read fails, and the one after.
	w.tickTo(w.now.Add(100 * time.Millisecond))
	r = w.renewal()
	w.step(RenewDone{Token: r.Token, Lease: kvstate.Lease{Revision: 3}, Sent: w.now, At: w.now})
	rt = only[ReadTable](w.acts)
	w.step(Confirmed{Incarnation: "inc1", Drops: rt[0].Drops, Err: errors.New("no responders")})
	if w.tickTo(w.now.Add(150 * time.Millisecond)); len(only[Renew](w.acts)) != 0 {
		t.Fatalf("retried before its backoff (200 ms): %s", describeActions(w.acts))
	}
	w.tickTo(w.now.Add(50 * time.Millisecond))
	r = w.renewal()
	w.step(RenewDone{Token: r.Token, Lease: kvstate.Lease{Revision: 4}, Sent: w.now, At: w.now})
	rt = only[ReadTable](w.acts)
	w.step(Confirmed{Incarnation: "inc1", Drops: rt[0].Drops, Rows: rows(protocol.StateActive, 1)})
	if res := only[Resume](w.acts); len(res) != 1 || w.c.Suspended() || counted(w.acts, countConfirmed) != 1 {
		t.Fatalf("confirmation: %s", describeActions(w.acts))
	}
}

// TestCoreLeaveAndClose: Leaving writes the leaving mark at once (after the
// write in flight) and signals once written, and again once no shard is
// held; Closing signals once no write is in flight, so that Close
// deregisters the lease written last.
func TestCoreLeaveAndClose(t *testing.T) {
	w := newRegWorld(t)
	w.c.maxEpoch = 1
	w.bindLive(1, 4)
	w.tickTo(w.now.Add(time.Second))
	inFlight := w.renewal()
	written, done := make(chan struct{}), make(chan struct{})
	w.step(Leaving{Written: written, Done: done})
	if len(only[Renew](w.acts)) != 0 || !w.c.Leaving() {
		t.Fatalf("leaving with a renewal in flight: %s", describeActions(w.acts))
	}
	w.step(RenewDone{Token: inFlight.Token, Lease: kvstate.Lease{Revision: 2}, Sent: w.now, At: w.now})
	r := w.renewal()
	if !r.Info.Leaving || r.Lease.Revision != 2 {
		t.Fatalf("the leaving write: %+v", r)
	}
	w.step(RenewDone{Token: r.Token, Lease: kvstate.Lease{Revision: 3}, Sent: w.now, At: w.now})
	if s := only[Signal](w.acts); len(s) != 1 || s[0].Ch != written {
		t.Fatalf("leaving written: %s", describeActions(w.acts))
	}
	w.cmd(protocol.CmdDrop, 1, 4)
	if s := only[Signal](w.acts); len(s) != 1 || s[0].Ch != done {
		t.Fatalf("no shard held: %s", describeActions(w.acts))
	}

	w.tickTo(w.now.Add(time.Second))
	last := w.renewal()
	quiet := make(chan struct{})
	w.step(Closing{Done: quiet})
	if len(only[Signal](w.acts)) != 0 {
		t.Fatalf("closing with a write in flight: %s", describeActions(w.acts))
	}
	w.step(RenewDone{Token: last.Token, Lease: kvstate.Lease{Revision: 4}, Sent: w.now, At: w.now})
	if s := only[Signal](w.acts); len(s) != 1 || s[0].Ch != quiet || w.c.Lease().Revision != 4 {
		t.Fatalf("closing: %s, lease %+v", describeActions(w.acts), w.c.Lease())
	}
	if w.tickTo(w.now.Add(2 * time.Second)); len(only[Renew](w.acts)) != 0 {
		t.Fatalf("a closing region renewed: %s", describeActions(w.acts))
	}
}

// TestCoreTakenOver: a fenced region whose id another live process
// registered meanwhile stops for good rather than take the registration back.
func TestCoreTakenOver(t *testing.T) {
	w := newRegWorld(t)
	w.step(Fenced{Reason: "registration lost"})
	w.tickTo(w.now.Add(50 * time.Millisecond))
	reg := only[Register](w.acts)
	if len(reg) != 1 || !reg[0].CheckTakeover {
		t.Fatalf("after the fence: %s", describeActions(w.acts))
	}
	w.step(RegisterDone{Token: reg[0].Token, At: w.now, Err: fmt.Errorf("check: %w", ErrRegionInUse)})
	if f := only[Fail](w.acts); len(f) != 1 || !errors.Is(f[0].Err, ErrRegionInUse) {
		t.Fatalf("taken over: %s", describeActions(w.acts))
	}
	if w.tickTo(w.now.Add(5 * time.Second)); len(only[Register](w.acts)) != 0 {
		t.Fatalf("registered again after failing: %s", describeActions(w.acts))
	}
	if r := w.answer(w.cmd(protocol.CmdProbe, 1)); !strings.Contains(r.Error, errNotRegistered.Error()) {
		t.Fatalf("probe of a failed region: %+v", r)
	}
}
