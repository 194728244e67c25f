package region

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// tickEvery is the period of the core's ticks.
const tickEvery = 50 * time.Millisecond

// epochCheckTimeout bounds the read of the coordinator lease that checks a
// new epoch.
const epochCheckTimeout = 5 * time.Second

// drainTimeout bounds how long a released shard's subscription may take
// to hand its queued messages to the buffer before it is cut.
const drainTimeout = 30 * time.Second

// commandIn is a command as the subscription got it, for the driver.
type commandIn struct {
	CommandIn
	msg *nats.Msg
}

// stopLoop ends the driver (Close).
type stopLoop struct{}

// synced is an event whose poster waits until the driver carried it out
// (postWait).
type synced struct {
	ev   Event
	done chan struct{}
}

func (commandIn) isEvent() {}
func (stopLoop) isEvent()  {}
func (synced) isEvent()    {}

// post gives an event to the driver. It returns at once when the agent is
// closing.
func (a *Agent) post(ev Event) {
	select {
	case a.events <- ev:
	case <-a.loopDone:
	}
}

// postWait posts ev and returns once the driver has carried out what it
// caused (or the agent closed).
func (a *Agent) postWait(ev Event) {
	done := make(chan struct{})
	a.post(synced{ev: ev, done: done})
	select {
	case <-done:
	case <-a.loopDone:
	}
}

// run is the driver: the only goroutine that touches the core.
func (a *Agent) run() {
	defer close(a.loopDone)
	t := time.NewTicker(tickEvery)
	defer t.Stop()
	for {
		if len(a.local) > 0 {
			ev := a.local[0]
			a.local = a.local[1:]
			if !a.handle(ev) {
				return
			}
			continue
		}
		select {
		case ev := <-a.events:
			if !a.handle(ev) {
				return
			}
		case now := <-t.C:
			// The events queued before the tick came before it: taken
			// first, so that a renewal's success never loses a race with
			// the deadline it met.
			for n := len(a.events); n > 0; n-- {
				if !a.handle(<-a.events) {
					return
				}
			}
			a.carryOut(a.core.Tick(now))
		}
	}
}

// handle steps the core with ev and carries out what it returns; false:
// the driver stops.
func (a *Agent) handle(ev Event) bool {
	var done chan struct{}
	switch e := ev.(type) {
	case stopLoop:
		return false
	case commandIn:
		a.replyTo[e.ID] = e.msg
		ev = e.CommandIn
	case synced:
		ev, done = e.ev, e.done
	}
	a.carryOut(a.core.Step(ev))
	if b, ok := ev.(Bound); ok {
		// The shards that could not be bound: the core forgot them.
		for _, n := range b.Failed {
			if st := a.shards[n]; st != nil && a.core.Mode(n) == modeGone {
				delete(a.shards, n)
				st.stop("its bind failed")
			}
		}
	}
	if done != nil {
		close(done)
	}
	return true
}

// carryOut publishes the core's view and its registration deadline, then
// does what the core asks, in order.
func (a *Agent) carryOut(acts []Action) {
	a.publish(true)
	var deadline int64
	if d := a.core.Deadline(); !d.IsZero() {
		deadline = a.clock.at(d)
	}
	a.clock.deadline.Store(deadline)
	for _, act := range acts {
		switch act := act.(type) {
		case Answer:
			a.answerCommand(act)
		case CheckEpoch:
			a.goDo(func() { a.post(EpochChecked{Epoch: act.Epoch, Err: a.checkEpoch(act.Epoch)}) })
		case BindShards:
			a.bindShards(act)
		case CheckSplit:
			a.goDo(func() {
				layout, err := a.checkSplit(act.Count)
				a.post(SplitChecked{ID: act.ID, Layout: layout, Err: err})
			})
		case SplitShards:
			a.splitShards(act)
		case GoLive:
			if st := a.shard(act.Shard, act.Life); st != nil {
				st.goLive()
				if a.cfg.Remember != nil {
					a.goDo(func() { a.restartRemembered(st, act.Shard) })
				}
			}
		case Suspend:
			if st := a.shard(act.Shard, act.Life); st != nil {
				st.suspend()
			}
		case Resume:
			if st := a.shard(act.Shard, act.Life); st != nil {
				st.resume()
			}
		case Pause:
			st := a.shard(act.Shard, act.Life)
			if st != nil {
				st.pause(act.Handoff)
			}
			a.reportPause(act.Shard, act.Handoff, a.stopEntities(act.Shard, act.Life, st))
		case Unbind:
			a.unbind(act)
		case Release:
			a.release(act)
		case Register:
			a.register(act)
		case Renew:
			a.renew(act)
		case ReadTable:
			a.readTable(act)
		case Opened:
			a.opened <- act.Err
		case Fail:
			a.fail(act.Err)
		case Signal:
			close(act.Ch)
		case Count:
			a.count(act.What)
		case Log:
			if act.Limit != "" {
				a.limit.log(a.log, act.Limit, act.Msg, act.Args...)
			} else {
				a.log.Log(context.Background(), act.Level, act.Msg, act.Args...)
			}
		}
	}
}

// count adds one to the counter of Stats that w names.
func (a *Agent) count(w counter) {
	switch w {
	case countFenced:
		a.stats.Fenced.Add(1)
	case countSuspended:
		a.stats.Suspended.Add(1)
	case countConfirmed:
		a.stats.Confirmed.Add(1)
	case countRenewalFailed:
		a.stats.RenewalsFailed.Add(1)
	}
}

// goDo runs f in a goroutine that Close waits for.
func (a *Agent) goDo(f func()) {
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		f()
	}()
}

// shard is the data plane of shard n in its life, nil if it has another.
func (a *Agent) shard(n int, life uint64) intake {
	if st := a.shards[n]; st != nil && st.life() == life {
		return st
	}
	return nil
}

// answerCommand sends the core's answer to its command.
func (a *Agent) answerCommand(act Answer) {
	m := a.replyTo[act.ID]
	delete(a.replyTo, act.ID)
	if act.Refused {
		a.stats.Refused.Add(1)
	}
	if act.Probe {
		act.Reply.Load = a.probeLoad(act.Reply.Held)
	}
	if m == nil || m.Reply == "" {
		return
	}
	data, err := protocol.Encode(act.Reply)
	if err == nil {
		err = m.Respond(data)
	}
	if err != nil {
		a.log.Debug("cannot answer a command", "err", err)
	}
}

// checkEpoch accepts an epoch newer than any the region has seen only if
// it is the coordinator lease's, read from the stream leader (see Core).
func (a *Agent) checkEpoch(epoch uint64) error {
	ctx, cancel := context.WithTimeout(a.ctx, epochCheckTimeout)
	defer cancel()
	info, rev, err := a.cfg.Store.Coordinator(ctx)
	if err != nil {
		return fmt.Errorf("cannot check epoch %d against the coordinator lease: %w", epoch, err)
	}
	current := info.Epoch
	if current == 0 { // before the lease's first renewal its revision is the epoch
		current = rev
	}
	if epoch != current {
		return fmt.Errorf("epoch %d is not the coordinator lease's (%d)", epoch, current)
	}
	return nil
}

// bindShards subscribes to each shard and starts its replay, then flushes
// in a goroutine and reports Bound (durable delivery: bindDurable).
func (a *Agent) bindShards(act BindShards) {
	if a.cfg.Stream != nil {
		a.bindDurable(act)
		return
	}
	var (
		failed []int
		errs   []error
	)
	for i, n := range act.Shards {
		if err := a.bind(n, act.Handoffs[i], act.Lives[i]); err != nil {
			failed = append(failed, n)
			errs = append(errs, err)
		}
	}
	a.goDo(func() {
		err := errors.Join(errs...)
		if ferr := a.cfg.Conn.Flush(); ferr != nil {
			err = errors.Join(err, fmt.Errorf("flush subscriptions: %w", ferr))
		}
		a.post(Bound{ID: act.ID, Failed: failed, Err: err})
	})
}

// unbind stops serving the shard at once: its subscription, its replay,
// what it held (dropped unanswered: see stop), its entities (their
// context ends first).
func (a *Agent) unbind(act Unbind) {
	st := a.shard(act.Shard, act.Life)
	if st != nil {
		delete(a.shards, act.Shard)
	}
	if st != nil {
		st.stop(act.Why)
	}
	// The shard may be another region's already: what its entities are
	// doing is cut short (their context ends), then they stop.
	a.host.AbortShard(act.Shard)
	a.stopEntities(act.Shard, act.Life, nil)
}

// release ends the source's part of a handoff for a shard held here (see
// intake.release), or writes the end marker of one not held (core
// delivery: its new owner waits for it), and reports ReleaseDone.
func (a *Agent) release(act Release) {
	var st intake
	if act.Held {
		if st = a.shards[act.Shard]; st != nil {
			delete(a.shards, act.Shard)
		}
	}
	a.goDo(func() {
		var err error
		switch {
		case st != nil:
			err = st.release(a.ctx, act.Handoff)
		case a.cfg.Stream == nil:
			err = a.mark(a.ctx, act.Shard, act.Handoff)
		}
		if err != nil {
			a.log.Warn("release: cannot append the end marker; the coordinator will ask again", "err", err)
		} else {
			a.log.Debug("released shard", "shard", act.Shard, "handoff", act.Handoff)
		}
		a.post(ReleaseDone{Token: act.Token, Err: err})
	})
}

// stopEntities stops the entities of shard n in the background and
// reports EntitiesStopped for the shard's life when they all have (and,
// for a paused shard, its intake settled). A stop under way is joined.
// The channel it returns is closed once the entities stopped.
func (a *Agent) stopEntities(n int, life uint64, paused intake) <-chan struct{} {
	ch, running := a.stopping[n], false
	if ch != nil {
		select {
		case <-ch: // stale
		default:
			running = true
		}
	}
	if !running {
		ch = make(chan struct{})
		a.stopping[n] = ch
		a.goDo(func() {
			// Not bounded by a context: every stop hook is (StopTimeout),
			// so the shard drains; and ch must mean "stopped".
			if err := a.host.StopShard(context.Background(), n); err != nil {
				a.log.Warn("stopping a shard's entities", "shard", n, "err", err)
			}
			close(ch)
		})
	}
	a.goDo(func() {
		<-ch
		if paused != nil {
			ctx, cancel := context.WithTimeout(a.ctx, settleWait)
			if err := paused.settle(ctx); err != nil {
				a.log.Warn("cannot confirm the acknowledgements of a paused shard; its next owner may handle some messages again", "shard", n, "err", err)
			}
			cancel()
		}
		a.post(EntitiesStopped{Shard: n, Life: life})
	})
	return ch
}

// probeLoad is the load report of a probe answer: the held shards whose
// rate is measured.
func (a *Agent) probeLoad(held []int) []protocol.ShardLoad {
	loads, measured := a.loads(slices.Clone(held))
	out := loads[:0]
	for i, l := range loads {
		if measured[i] {
			out = append(out, l)
		}
	}
	return out
}
