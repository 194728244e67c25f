package host

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
)

// stopEntity runs ent's Stop hook, bounded by the stop timeout and by the
// host's limit of concurrent stops. A hook that outlives its timeout is
// abandoned (it keeps running in its own goroutine) and the entity counts as
// stopped.
func (h *Host) stopEntity(shard int, id string, ent Entity) {
	h.stopSem <- struct{}{}
	defer func() { <-h.stopSem }()
	ctx, cancel := context.WithTimeout(context.Background(), h.stopTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				h.log.Error("region: entity stop hook panicked",
					"shard", shard, "entity", id, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
				done <- errEntityPanicked
			}
		}()
		done <- ent.Stop(ctx)
	}()
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, errEntityPanicked) {
			h.log.Warn("region: entity stop hook failed", "shard", shard, "entity", id, "error", err)
		}
	case <-ctx.Done():
		h.log.Warn("region: entity stop hook exceeded the stop timeout; abandoned",
			"shard", shard, "entity", id, "timeout", h.stopTimeout.String())
	}
}

// stopItem is a cell queued for a stop (passivation or shard stop).
type stopItem struct {
	se    *shardEntities
	id    string
	c     *cell
	idle  bool // a passivation
	limit bool // a passivation for MaxActive
}

// runStops stops the queued cells with a bounded number of workers. It
// returns at once.
func (h *Host) runStops(items []stopItem) {
	if len(items) == 0 {
		return
	}
	var next atomic.Int64
	workers := min(len(items), maxConcurrentStops)
	for range workers {
		go func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(items) {
					return
				}
				h.stopCell(items[i])
			}
		}()
	}
}

// stopCell completes a queued stop of a cell the caller marked running with
// stop == stopQueued.
func (h *Host) stopCell(it stopItem) {
	se, c := it.se, it.c
	se.mu.Lock()
	if c.stop != stopQueued || c.mailbox.len() > 0 {
		// A delivery cancelled the passivation: run the messages.
		c.stop = stopNone
		se.mu.Unlock()
		h.schedule(task{se: se, c: c, id: it.id})
		return
	}
	c.stop = stopRunning
	ent := c.entity
	if se.timers != nil {
		h.dropTimersLocked(se, c)
	}
	se.mu.Unlock()

	if ent != nil {
		h.stopEntity(it.se.n, it.id, ent)
		if it.idle {
			h.passivations.Add(1)
		}
		if it.limit {
			h.overLimit.Add(1)
		}
	}

	se.mu.Lock()
	c.stop = stopNone
	c.entity = nil
	if c.mailbox.len() > 0 {
		// Messages arrived during Stop: a new incarnation handles them,
		// counted by the limit at once (a check during Stop may have
		// detached its entry again, after those messages' touches).
		if h.limit != nil {
			h.touchLimit(se, c, it.id, true)
		}
		se.mu.Unlock()
		h.schedule(task{se: se, c: c, id: it.id})
		return
	}
	c.running = false
	freeMailq(c.mailbox)
	c.mailbox = nil
	h.removeLocked(se, it.id, c)
	se.mu.Unlock()
}

// PassivateIdle starts stopping every entity that has been idle for at
// least IdleTimeout (empty mailbox, not running) and returns how
// many it started. The Stop hooks run in the background; see host. It does
// nothing when IdleTimeout is 0. The region calls it periodically.
func (h *Host) PassivateIdle() int {
	if h.idleTimeout <= 0 {
		return 0
	}
	deadline := h.now() - int64(h.idleTimeout)
	var items []stopItem
	for se := range h.table.each() {
		se.mu.Lock()
		if se.closing {
			se.mu.Unlock()
			continue
		}
		// Maps never shrink: rebuild one that lost most of its entries
		// (removed by earlier sweeps).
		if se.peak >= 1024 && len(se.cells)*4 < se.peak {
			se.cells = cloneCells(se.cells)
			se.peak = len(se.cells)
		}
		for id, c := range se.cells {
			if c.running || c.mailbox.len() > 0 || c.lastActive > deadline {
				continue
			}
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, id: id, c: c, idle: true})
		}
		se.mu.Unlock()
	}
	h.runStops(items)
	return len(items)
}

func cloneCells(m map[string]*cell) map[string]*cell {
	out := make(map[string]*cell, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// beginStop marks the shard closing and appends the stops of its idle cells
// to items; running cells stop themselves when their mailbox is empty. It
// returns the channel closed when the shard is drained (already closed when
// it holds nothing).
func (h *Host) beginStop(se *shardEntities, items []stopItem) (<-chan struct{}, []stopItem) {
	se.mu.Lock()
	if !se.closing {
		se.closing = true
		se.drained = make(chan struct{})
		se.releaseLocked() // the shard is stopped as the region's: its held messages are handled
		h.dropShardTimersLocked(se)
		for id, c := range se.cells {
			if c.running {
				continue // its worker, or a queued passivation, stops it
			}
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, id: id, c: c})
		}
	}
	drained := se.drained
	h.drainedLocked(se)
	se.mu.Unlock()
	return drained, items
}

// Evict stops the entities of shard whose id leaves says are no longer
// its own (a split gave them to a child: docs/PROTOCOL.md, Resharding) and
// removes their cells: an idle one at once, one with messages queued once
// it has handled them (nothing more is delivered to them: the region
// routes their messages to the child). Their Stop hook runs, and they stay
// remembered (their child starts them again). It returns a channel closed
// once all are removed. The shard's other entities are left alone. It is
// not called again on a shard before its channel closed.
func (h *Host) Evict(shard int, leaves func(id string) bool) <-chan struct{} {
	done := make(chan struct{})
	se := h.lookup(shard)
	if se == nil {
		close(done)
		return done
	}
	var items []stopItem
	ev := &eviction{done: done}
	se.mu.Lock()
	for id, c := range se.cells {
		if !leaves(id) {
			continue
		}
		c.evict = true
		ev.left++
		if !c.running {
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, id: id, c: c})
		}
	}
	if ev.left == 0 {
		close(done)
	} else {
		se.evicting = ev
	}
	se.mu.Unlock()
	h.runStops(items)
	return done
}

// StopShard stops every entity of shard: from now on deliveries to it are
// refused, messages already queued are handled, then the Stop hooks run and
// the entities are removed. It returns when all are stopped, or with ctx's
// error when ctx ends first (the stops then go on in the background). The
// region unsubscribes the shard before calling it.
func (h *Host) StopShard(ctx context.Context, shard int) error {
	se := h.lookup(shard)
	if se == nil {
		return nil
	}
	drained, items := h.beginStop(se, nil)
	h.runStops(items)
	select {
	case <-drained:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop shard %d: %w", shard, ctx.Err())
	}
}

// StopAll stops every shard the host holds, as StopShard does, all at once.
func (h *Host) StopAll(ctx context.Context) error {
	var (
		items  []stopItem
		shards []int
		waits  []<-chan struct{}
	)
	for se := range h.table.each() {
		var d <-chan struct{}
		d, items = h.beginStop(se, items)
		shards = append(shards, se.n)
		waits = append(waits, d)
	}
	h.runStops(items)
	var errs []error
	for i, d := range waits {
		select {
		case <-d:
		case <-ctx.Done():
			errs = append(errs, fmt.Errorf("stop shard %d: %w", shards[i], ctx.Err()))
		}
	}
	return errors.Join(errs...)
}

// PassivateNow starts stopping entity id of shard as an idle passivation
// does (its Stop hook runs; it is not forgotten when remembered), if it
// is active here and idle. It reports whether the entity is held
// (active, being created or stopped) and whether its stop was started:
// held and not started means busy (running or with messages queued), to
// be asked again.
func (h *Host) PassivateNow(shard int, id string) (held, started bool) {
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
