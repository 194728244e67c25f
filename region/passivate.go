package region

// passivateNow starts stopping entity id of shard as an idle passivation
// does (its Stop hook runs; it is not forgotten when remembered), if it
// is active here and idle. It reports whether the entity is held
// (active, being created or stopped) and whether its stop was started:
// held and not started means busy (running or with messages queued), to
// be asked again.
func (h *host) passivateNow(shard int, id string) (held, started bool) {
	se := h.lookup(shard)
	if se == nil {
		return false, false
	}
	se.mu.Lock()
	c := se.cells[id]
	if c == nil {
		se.mu.Unlock()
		return false, false
	}
	if se.closing || c.running || c.mailbox.len() > 0 || c.stop != stopNone || c.entity == nil {
		se.mu.Unlock()
		return true, false
	}
	c.running = true
	c.stop = stopQueued
	se.mu.Unlock()
	h.runStops([]stopItem{{se: se, id: id, c: c, idle: true}})
	return true, true
}

// PassivateNow stops entity id of shard as an idle passivation does (for
// tests and operators: an entity that wants to stop calls Passivate): if
// it is idle, its Stop hook runs in the background. It reports whether
// the entity is held here, and whether its stop began (false while it is
// busy: ask again).
func (a *Agent) PassivateNow(shard int, id string) (held, started bool) {
	return a.host.passivateNow(shard, id)
}
