package host

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
)

// Flusher is an Entity that stores the effect of several messages of
// durable delivery in one write (group commit): its Handle applies a
// message in memory only when WillFlush(ctx) says that Flush follows,
// and Flush stores what the Handle calls since the last Flush changed.
//
// In durable delivery (Message.Seq, SeqFrom: not 0) the runtime calls
// Flush after a run of the entity's messages and before it answers or
// acknowledges any of them: a message's effect is never acknowledged or
// answered before the state that holds it is stored. A run is at most
// MaxRun messages, all of them queued for the entity when its worker
// took them (the runtime never waits for more); it ends early before a
// message that is not of durable delivery (a timer's), and before a
// message whose idempotency key is one of the run's. Handle and Flush
// are called from one goroutine at a time, as Handle alone.
//
// When Flush fails (or panics, or a Handle of the run panics), none of
// the run's messages is answered or acknowledged: the runtime drops the
// incarnation without calling Stop (its state in memory holds effects
// that were not stored; its timers end), and a new incarnation (the
// Factory, which loads the stored state) handles the run's messages
// again, in order, each followed by its own Flush. A persistent entity
// skips a message at or below the sequence its stored state applied
// (SeqFrom), so each takes effect once. A Flush that fails for a run of
// one message is handled as a failed Handle is: with ErrUnavailable the
// message is handled again after a pause (by a new incarnation), after
// ErrConflict once more at once, and any other error is its answer (the
// message is consumed).
//
// In core delivery (SeqFrom is 0) Flush is never called and WillFlush
// is false: Handle stores its change itself. An entity that does not
// implement Flusher (one wrapped in another that does not pass Flush
// on, too: WillFlush is then false) is answered and acknowledged after
// each Handle, as before.
type Flusher interface {
	Entity
	// Flush stores the changes of the Handle calls since the last
	// Flush; nothing to store is a success. ctx is the entity's.
	Flush(ctx context.Context) error
}

// MaxRun bounds the messages of one Flusher's run: the latency a
// message gains waiting for the run's last one to be applied is at most
// MaxRun applications in memory, and a run is the messages a worker
// handles for the cell in one turn (turnBudget) at most.
const MaxRun = turnBudget

// pending is a message of the current run: handled in memory, answered
// and acknowledged once the run's Flush stored its effect.
type pending struct {
	e    envelope
	data []byte
	err  error
	key  string // the message's idempotency key ("" for none, or for a message asking the answer of a key)
	keep bool   // Handle answered it: its answer is kept under key
}

// errRunLost ends a run whose incarnation ended (a Handle panicked)
// before its Flush.
var errRunLost = errors.New("the entity's incarnation ended before its changes were stored")

// joinsRun reports whether the message e can join the run: a message of
// durable delivery whose idempotency key is not one of the run's (the
// second would be answered by the first, whose answer is kept only once
// the run is stored).
func joinsRun(run []pending, e envelope) bool {
	if e.m == nil || e.d == nil {
		return false
	}
	if e.m.Header == nil {
		return true
	}
	key, _ := answerKey(e.m.Header)
	if key == "" {
		return true
	}
	for i := range run {
		if run[i].key == key {
			return false
		}
	}
	return true
}

// endRun ends the run of entity id (w.run): Flush stores the effects of
// its messages, then each is answered and acknowledged, in order. When
// the run failed (Flush failed or panicked, or ent is nil: a Handle of
// the run panicked) none is: the incarnation is dropped and the run's
// messages are handled again, one at a time, each with its own Flush
// (Flusher). It returns the entity and how many messages were answered
// with an error.
func (h *Host) endRun(se *shardEntities, id string, c *cell, ent Entity, w *workerState) (_ Entity, failed uint64) {
	run := w.run
	if len(run) == 0 {
		return ent, 0
	}
	defer func() {
		clear(run)
		w.run = run[:0]
	}()
	var err error
	if ent == nil {
		err = errRunLost
	} else {
		err = h.flush(se, id, ent.(Flusher))
	}
	if err == nil {
		for i := range run {
			p := &run[i]
			if p.keep {
				h.keep(se, c, p.key, p.data, p.err)
			}
			h.reply(se.n, id, p.e.m, p.data, p.err)
			p.e.d.done()
			if p.err != nil {
				failed++
			}
		}
		return ent, failed
	}
	h.log.Warn("region: the changes of a run of durable messages could not be stored; its messages are handled again, one at a time",
		"shard", se.n, "entity", id, "messages", len(run), "error", err)
	h.dropTimers(se, c)
	ent = nil
	for i := range run {
		if se.ctx.Err() != nil {
			return nil, failed // the shard left: the rest stays in the stream
		}
		if ent, err = h.deliverOne(se, id, c, ent, run[i].e, &w.msg, nil); err != nil {
			failed++
		}
		if ent == nil {
			h.dropTimers(se, c)
		}
	}
	return ent, failed
}

// flush calls fl.Flush with the shard's context; a panic is recovered
// (logged, and returned as errEntityPanicked).
func (h *Host) flush(se *shardEntities, id string, fl Flusher) (err error) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity's Flush panicked",
				"shard", se.n, "entity", id, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			err = errEntityPanicked
		}
	}()
	return fl.Flush(se.ctx)
}
