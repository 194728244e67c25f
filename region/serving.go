package region

// Serving tells code that runs on its own, outside the messages (natshard's
// daemon workers), when the region serves a shard: only then may it act
// for the shard, since the shard is this region's alone only while it is
// live here and the region is registered and connected.

// Serving reports whether the region serves shard n now: it holds the
// shard live (not replaying its buffer, not paused for a handoff), it is
// registered (not fenced) and not suspended (its connection dropped, or it
// stalled, and it has not confirmed its shards since), and it is not
// closing. changed is closed at the next change of any of these, for any
// shard: look again then.
//
// A shard stops being served the moment its handoff is decided (before
// its entities are stopped), its connection drops (Suspend), the region
// fences itself or closes; it is served again only once the core confirmed
// it after a suspension, or the shard went live after a bind.
func (a *Agent) Serving(n int) (serving bool, changed <-chan struct{}) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.servingCh == nil {
		a.servingCh = make(chan struct{})
	}
	return a.registered && !a.suspended && !a.closed && a.modes[n] == modeLive, a.servingCh
}

// servingChangedLocked wakes the callers of Serving waiting for a change;
// a.mu is held.
func (a *Agent) servingChangedLocked() {
	if a.servingCh != nil {
		close(a.servingCh)
		a.servingCh = nil
	}
}
