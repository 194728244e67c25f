package region

import (
	"maps"
	"slices"
)

// Serving tells code that runs on its own, outside the messages (natshard's
// daemon workers), when the region serves a shard: only then may it act
// for the shard, since the shard is this region's alone only while it is
// live here and the region is registered and connected.

// Serving reports whether the region serves shard n now: it holds the
// shard live (not replaying its buffer, not paused for a handoff), it is
// registered (not fenced) and not suspended (its connection dropped, or it
// stalled, and it has not confirmed its shards since), and it is not
// closing. changed is closed at the next change of any of these, for any
// shard, just after the new state is in place (so a goroutine woken by it
// reads the new state): look again then.
//
// A shard stops being served the moment its handoff is decided (before
// its entities are stopped), its connection drops (Suspend), the region
// fences itself or closes; it is served again only once the core confirmed
// it after a suspension, or the shard went live after a bind.
func (a *Agent) Serving(n int) (serving bool, changed <-chan struct{}) {
	v := a.viewNow()
	return v.registered && !v.suspended && !v.closed && v.modes[n] == modeLive, v.changed
}

// view is the core's state as the driver published it after its last
// step, for the other goroutines (Serving, Status, Held, queries, the
// load reports). It is never changed, only replaced, by the driver alone
// (Close's once the driver returned).
type view struct {
	registered, suspended, closed, leaving bool
	incarnation                            string
	epoch                                  uint64
	held                                   []int
	modes                                  map[int]mode
	changed                                chan struct{} // closed when the view is replaced
}

// viewNow is the view published last (an empty view for an Agent made
// without Open: tests).
func (a *Agent) viewNow() *view {
	if v := a.view.Load(); v != nil {
		return v
	}
	return &view{}
}

// publish replaces the view with the core's state when it differs
// (registered as the core says, or false: Close, once deregistered).
func (a *Agent) publish(registered bool) {
	c := a.core
	held := c.Held()
	v := &view{
		registered: registered && c.Registered(), suspended: c.Suspended(), closed: c.Closed(), leaving: c.Leaving(),
		incarnation: c.Incarnation(), epoch: c.Epoch(), held: held, modes: make(map[int]mode, len(held)),
	}
	for _, n := range held {
		v.modes[n] = c.Mode(n)
	}
	old := a.view.Load()
	if old != nil && old.registered == v.registered && old.suspended == v.suspended && old.closed == v.closed &&
		old.leaving == v.leaving && old.incarnation == v.incarnation && old.epoch == v.epoch &&
		slices.Equal(old.held, v.held) && maps.Equal(old.modes, v.modes) {
		return
	}
	v.changed = make(chan struct{})
	a.view.Store(v) // before the close: whoever the close wakes reads v
	if old != nil {
		close(old.changed)
	}
}
