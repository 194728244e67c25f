package host

import "slices"

// Counts are the host's counters, since it was made.
type Counts struct {
	Active       int    // entities held (created, being created or stopped)
	Activations  uint64 // entities created by the Factory
	Passivations uint64 // idle entities stopped (IdleTimeout or MaxActive)
	OverLimit    uint64 // of those, stopped because the region held more than MaxActive
	// Delivered: messages handed to entities (live, replayed or held;
	// not those refused because their shard was being stopped).
	Delivered uint64
	// Handled: messages whose handling ended (Handle returned or
	// panicked, or the entity could not be created); Failed: of those,
	// the ones answered with an error.
	Handled, Failed uint64
	// RefusedStopping: messages no entity got because their shard's
	// entities were being stopped (the shard was leaving): refused, or
	// dropped unanswered where its next holder may answer a copy.
	RefusedStopping uint64
}

// Counts returns the host's counters.
func (h *Host) Counts() Counts {
	c := h.msgCounts()
	return Counts{
		Active: h.Active(), Activations: h.activations.Load(), Passivations: h.passivations.Load(), OverLimit: h.overLimit.Load(),
		Delivered: c.delivered, Handled: c.handled, Failed: c.failed, RefusedStopping: h.refusedStopping.Load(),
	}
}

// msgCounts count the messages queued for a shard's entities and those
// they handled; each shard keeps its own under its lock, and the host
// keeps those of the shards it forgot. (A count shared by the shards, an
// atomic, was a cache line that every message moved from core to core.)
type msgCounts struct{ delivered, handled, failed uint64 }

func (c *msgCounts) add(d msgCounts) {
	c.delivered += d.delivered
	c.handled += d.handled
	c.failed += d.failed
}

// msgCounts sums the counts of the shards held and of those forgotten. A
// shard is either held or counted in h.gone (drainedLocked moves it
// under h.mu), and its count only grows, so the sum never goes down
// from one call to the next.
func (h *Host) msgCounts() msgCounts {
	h.mu.RLock()
	total, held := h.gone, slices.Collect(h.table.each())
	h.mu.RUnlock()
	for _, se := range held {
		se.mu.Lock()
		total.add(se.counts)
		se.mu.Unlock()
	}
	return total
}

// ShardLoad returns how many messages the host queued for shard since it
// began holding it, and how many entities it holds for it.
func (h *Host) ShardLoad(shard int) (delivered uint64, entities int) {
	se := h.lookup(shard)
	if se == nil {
		return 0, 0
	}
	se.mu.Lock()
	defer se.mu.Unlock()
	return se.counts.delivered, len(se.cells)
}

// Active returns how many entities the host holds (created, being created
// or stopped).
func (h *Host) Active() int {
	n := 0
	for se := range h.table.each() {
		se.mu.Lock()
		n += len(se.cells)
		se.mu.Unlock()
	}
	return n
}

// Entities returns the sorted ids of the entities held for shard.
func (h *Host) Entities(shard int) []string {
	se := h.lookup(shard)
	if se == nil {
		return nil
	}
	se.mu.Lock()
	ids := make([]string, 0, len(se.cells))
	for id := range se.cells {
		ids = append(ids, id)
	}
	se.mu.Unlock()
	slices.Sort(ids)
	return ids
}
