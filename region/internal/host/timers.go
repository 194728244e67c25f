package host

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
)

// Timers of entities (Akka's withTimers, Orleans' RegisterTimer): an
// active entity arms a named timer (StartTimer); when it fires, a message
// goes into the entity's own mailbox (no NATS hop) and Handle gets it in
// the entity's turn, one at a time with its other messages, with
// Message.Timer() == name.
//
// A timer belongs to the entity's activation: it is cancelled when the
// entity stops (passivation, its shard's handoff, drop or fence, a panic
// of Handle) and never fires after. A timer's message already queued when
// the timer is cancelled, re-armed, or its shard began to stop is dropped
// before Handle: a cancelled timer's message never reaches Handle.
//
// Cost: one runtime timer (time.AfterFunc) per armed timer, no goroutine
// while it waits; the timers of an entity live in its shard's map
// (shardEntities.timers), made on the first timer: an entity without
// timers costs nothing more (its cell is unchanged).

// Errors of StartTimer.
var (
	// ErrNotActive: the entity is not active in this region, or is being
	// stopped (its Stop hook runs, or its shard is being stopped): a timer
	// is armed by the entity itself, from its Factory or Handle.
	ErrNotActive = errors.New("region: entity not active here")
	// ErrTimerName: a timer's name is empty.
	ErrTimerName = errors.New("region: timer name is empty")
)

// entityTimer is one armed timer of an entity; guarded by its shard's
// mutex.
type entityTimer struct {
	name  string
	data  []byte
	every time.Duration // 0: single-shot
	t     *time.Timer   // nil while its message is queued (not armed)
	gen   uint64        // which arming of the timer: a fire or queued message of another is stale
}

// entityTimers are an entity's timers, in the order they were first set.
type entityTimers struct {
	list []*entityTimer
	gen  uint64 // last generation given
}

func (ts *entityTimers) find(name string) int {
	return slices.IndexFunc(ts.list, func(t *entityTimer) bool { return t.name == name })
}

// timerFire is what a timer's message carries in the mailbox: which
// arming of which timer it comes from.
type timerFire struct {
	name string
	gen  uint64
}

// StartTimer arms entity id's timer name: after d (and, when periodic,
// every d after each message was handled: a fixed delay, so that a slow
// entity never gets a pile of them), the entity gets data with
// Message.Timer() == name. A timer of that name already armed is
// replaced (reset): its message, even one queued already, never comes.
func (h *Host) StartTimer(shard int, id, name string, d time.Duration, periodic bool, data []byte) error {
	if name == "" {
		return ErrTimerName
	}
	if periodic && d <= 0 {
		return fmt.Errorf("region: periodic timer %q: interval %s, want > 0", name, d)
	}
	se := h.lookup(shard)
	if se == nil {
		return ErrNotActive
	}
	se.mu.Lock()
	defer se.mu.Unlock()
	c := se.cells[id]
	if c == nil || se.closing || c.stop == stopRunning {
		return ErrNotActive
	}
	if se.timers == nil {
		se.timers = make(map[*cell]*entityTimers)
	}
	ts := se.timers[c]
	if ts == nil {
		ts = &entityTimers{}
		se.timers[c] = ts
	}
	var et *entityTimer
	if i := ts.find(name); i >= 0 {
		et = ts.list[i]
		if et.t != nil {
			et.t.Stop()
		}
	} else {
		et = &entityTimer{name: name}
		ts.list = append(ts.list, et)
	}
	ts.gen++
	et.gen, et.data, et.every = ts.gen, slices.Clone(data), 0
	if periodic {
		et.every = d
	}
	h.armLocked(se, c, id, et, max(d, 0))
	return nil
}

// armLocked starts et's runtime timer (se.mu held).
func (h *Host) armLocked(se *shardEntities, c *cell, id string, et *entityTimer, d time.Duration) {
	gen := et.gen
	et.t = time.AfterFunc(d, func() { h.fireTimer(se, c, id, et, gen) })
}

// timersOf returns entity id's timers in shard with se locked, or nil
// (se nil too when the shard is not here). The caller unlocks se.mu when
// se is not nil.
func (h *Host) timersOf(shard int, id string) (*shardEntities, *cell, *entityTimers) {
	se := h.lookup(shard)
	if se == nil {
		return nil, nil, nil
	}
	se.mu.Lock()
	c := se.cells[id]
	if c == nil {
		return se, nil, nil
	}
	return se, c, se.timers[c]
}

// CancelTimer cancels entity id's timer name and reports whether it was
// armed (or its message queued).
func (h *Host) CancelTimer(shard int, id, name string) bool {
	se, c, ts := h.timersOf(shard, id)
	if se == nil {
		return false
	}
	defer se.mu.Unlock()
	i := -1
	if ts != nil {
		i = ts.find(name)
	}
	if i < 0 {
		return false
	}
	h.removeTimerLocked(se, c, ts, i)
	return true
}

// TimerActive reports whether entity id's timer name is armed or its
// message queued.
func (h *Host) TimerActive(shard int, id, name string) bool {
	se, _, ts := h.timersOf(shard, id)
	if se == nil {
		return false
	}
	defer se.mu.Unlock()
	return ts != nil && ts.find(name) >= 0
}

// removeTimerLocked stops and forgets ts.list[i], c's (se.mu held).
func (h *Host) removeTimerLocked(se *shardEntities, c *cell, ts *entityTimers, i int) {
	if t := ts.list[i].t; t != nil {
		t.Stop()
	}
	ts.list = slices.Delete(ts.list, i, i+1)
	if len(ts.list) == 0 {
		delete(se.timers, c)
	}
}

// dropTimersLocked cancels every timer of c (se.mu held): its entity
// stops, or its incarnation ended.
func (h *Host) dropTimersLocked(se *shardEntities, c *cell) {
	ts := se.timers[c]
	if ts == nil {
		return
	}
	for _, et := range ts.list {
		if et.t != nil {
			et.t.Stop()
		}
	}
	delete(se.timers, c)
}

// dropTimers is dropTimersLocked, taking se.mu.
func (h *Host) dropTimers(se *shardEntities, c *cell) {
	se.mu.Lock()
	if se.timers != nil {
		h.dropTimersLocked(se, c)
	}
	se.mu.Unlock()
}

// dropShardTimersLocked cancels the timers of every entity of se (se.mu
// held): the shard is leaving the region.
func (h *Host) dropShardTimersLocked(se *shardEntities) {
	for c := range se.timers {
		h.dropTimersLocked(se, c)
	}
	se.timers = nil
}

// fireTimer queues the message of et (arming gen) for its entity, unless
// the timer was cancelled or re-armed, or its entity or shard is going.
// It runs in the runtime timer's goroutine.
func (h *Host) fireTimer(se *shardEntities, c *cell, id string, et *entityTimer, gen uint64) {
	se.mu.Lock()
	ts := se.timers[c]
	if ts == nil || et.gen != gen || ts.find(et.name) < 0 || se.closing || se.cells[id] != c || c.stop == stopRunning {
		se.mu.Unlock()
		return
	}
	et.t = nil // not armed while its message is queued
	e := envelope{
		m:     &nats.Msg{Data: et.data},
		timer: &timerFire{name: et.name, gen: gen},
	}
	if h.stalls != nil {
		e.stalls = h.stalls(false)
	}
	h.queueLocked(se, c, id, e)
}

// takeTimer is called by the entity's worker before it gives a timer's
// message to Handle: it reports whether the message is still due (its
// timer was neither cancelled nor re-armed since, and the shard is not
// stopping). A single-shot timer is then done; a periodic one is armed
// again, its interval from now.
func (h *Host) takeTimer(se *shardEntities, c *cell, id string, f *timerFire) bool {
	se.mu.Lock()
	defer se.mu.Unlock()
	ts := se.timers[c]
	if ts == nil || se.closing {
		return false
	}
	i := ts.find(f.name)
	if i < 0 || ts.list[i].gen != f.gen {
		return false
	}
	et := ts.list[i]
	if et.every <= 0 {
		ts.list = slices.Delete(ts.list, i, i+1)
		if len(ts.list) == 0 {
			delete(se.timers, c)
		}
		return true
	}
	h.armLocked(se, c, id, et, et.every)
	return true
}

// Timer is the name of the entity's timer that sent the message (see
// region.Agent.StartTimer), "" for any other message. A timer's message has no
// subject, reply or header; its Data is the data the timer was started
// with (shared by each of its messages: do not modify it).
func (m *Message) Timer() string { return m.timer }
