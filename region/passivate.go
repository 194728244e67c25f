package region

// PassivateNow stops entity id of shard as an idle passivation does (for
// tests and operators: an entity that wants to stop calls Passivate): if
// it is idle, its Stop hook runs in the background. It reports whether
// the entity is held here, and whether its stop began (false while it is
// busy: ask again).
func (a *Agent) PassivateNow(shard int, id string) (held, started bool) {
	return a.host.PassivateNow(shard, id)
}
