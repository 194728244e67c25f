package host

import "hash/maphash"

// touchBatch is how many touches of the limit's policy a shard keeps
// before it gives them to the policy under one lock of it (as Caffeine's
// read buffers): the policy's mutex, shared by every shard, taken for
// each message, made BenchmarkDeliver 1.8 times slower with MaxActive.
const touchBatch = 32

// touchLimit records a message to cell c of entity id (se.mu held; id is
// c's key in se.cells) in the limit's policy. The cell's first message
// gives it its entry, added at once, as is a touch said to be now (its
// entry may be detached: an entry detached for a passivation that did not
// happen, because a message cancelled it, is added again as a newly
// activated entity). Other touches wait in se.touches, touchBatch at a
// time: PassivateOverLimit gives them to the policy before it asks it for
// entities to passivate, so that it decides on every message so far; the
// cost is the order among shards' touches, by shard rather than by time,
// within one check (limitEvery). A cell being stopped (c.stop) may have
// its entry detached: the caller says now.
func (h *Host) touchLimit(se *shardEntities, c *cell, id string, now bool) {
	if c.lim == nil {
		x := maphash.String(h.limitSeed, id)
		c.lim = &limitEntry{Hash: uint32(x ^ x>>32), Value: limitRef{id: id, shard: se.n}}
		now = true
	}
	if !now {
		se.touches = append(se.touches, c.lim)
		if len(se.touches) >= touchBatch {
			h.flushTouchesLocked(se)
		}
		return
	}
	h.limitMu.Lock()
	h.limit.Touch(c.lim)
	h.limitMu.Unlock()
}

// flushTouchesLocked gives se's waiting touches to the limit's policy
// (se.mu held). A touch of an entry detached meanwhile is dropped: its
// entity was removed, or chosen to be passivated (if a message cancels
// that, the message's touch adds the entry again).
func (h *Host) flushTouchesLocked(se *shardEntities) {
	if len(se.touches) == 0 {
		return
	}
	h.limitMu.Lock()
	for _, e := range se.touches {
		if e.Attached() {
			h.limit.Touch(e)
		}
	}
	h.limitMu.Unlock()
	clear(se.touches)
	se.touches = se.touches[:0]
}

// PassivateOverLimit starts stopping the idle entities (empty mailbox, not
// running) that the limit's policy values least, until the
// policy holds no more than MaxActive, and returns how many it started.
// The entities being stopped for the limit are detached from the policy,
// so they count as gone already. A busy entity is never chosen: the policy
// gets it back as just used, and the next choice is asked for; so the host
// holds more than MaxActive while more than MaxActive are busy. A message
// that arrives before the Stop hook has begun cancels the passivation (the
// entity was used again, and rejoins the policy as newly activated). It
// does nothing when MaxActive is 0. The region calls it often: under the
// limit it costs a lock of each shard (to flush its touches) and one of
// the policy; over it, a lock of a shard per entity chosen.
func (h *Host) PassivateOverLimit() int {
	if h.limit == nil {
		return 0
	}
	for se := range h.table.each() {
		se.mu.Lock()
		h.flushTouchesLocked(se)
		se.mu.Unlock()
	}
	var (
		items   []stopItem
		victims []*limitEntry
		budget  = -1 // entries the policy may still offer in this call
	)
	for {
		h.limitMu.Lock()
		held := h.limit.Len()
		if budget < 0 {
			budget = held
		}
		need := min(held-h.maxActive, budget)
		if need <= 0 {
			h.limitMu.Unlock()
			break
		}
		victims = h.limit.Evict(need, victims[:0])
		h.limitMu.Unlock()
		if len(victims) == 0 {
			break
		}
		budget -= len(victims)
		for _, e := range victims {
			if it, ok := h.takeOverLimit(e); ok {
				items = append(items, it)
			}
		}
	}
	h.runStops(items)
	return len(items)
}

// takeOverLimit queues the stop of the entity of e, detached from the
// limit's policy, if it is idle. A busy entity goes back to the policy;
// one gone or on its way out is left alone (its cell is being removed, or
// its next message attaches it again).
func (h *Host) takeOverLimit(e *limitEntry) (stopItem, bool) {
	ref := e.Value
	se := h.lookup(ref.shard)
	if se == nil {
		return stopItem{}, false
	}
	se.mu.Lock()
	defer se.mu.Unlock()
	c := se.cells[ref.id]
	switch {
	case c == nil || c.lim != e || se.closing || c.stop != stopNone:
		return stopItem{}, false
	case c.running || c.mailbox.len() > 0 || c.entity == nil:
		h.touchLimit(se, c, ref.id, true) // detached by Evict: added again
		return stopItem{}, false
	}
	c.running = true
	c.stop = stopQueued
	return stopItem{se: se, id: ref.id, c: c, idle: true, limit: true}, true
}
