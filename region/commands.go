package region

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/drain"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// drainTimeout bounds how long a released shard's subscription may take
// to hand its queued messages to the buffer before it is cut.
const drainTimeout = 30 * time.Second

// onCommand handles a coordinator command. It runs on the command
// subscription's goroutine, so commands are handled one at a time: each
// command's state changes are made here, in order. A command that must
// wait (handoff: entities stopping; release: grace period and end marker;
// leave: registration write) is answered from a goroutine of its own, so
// that it does not hold up the commands after it.
//
// Every command is idempotent: the coordinator resends a command until it
// gets an answer without error.
func (a *Agent) onCommand(m *nats.Msg) {
	var cmd protocol.Command
	err := protocol.Decode(m.Data, &cmd)
	if err == nil {
		err = cmd.Validate(a.cfg.Shards)
	}
	if err != nil {
		a.stats.Refused.Add(1)
		a.limit.log(a.log, "bad-command", "refused a malformed command", "err", err)
		a.answer(m, protocol.Reply{Error: err.Error()})
		return
	}
	epochErr := a.checkEpoch(cmd.Epoch)
	a.mu.Lock()
	reply := protocol.Reply{Incarnation: a.incarnation}
	switch {
	case epochErr != nil:
		reply.Error = epochErr.Error()
	case a.closed:
		reply.Error = "region is closing"
	case !a.registered:
		reply.Error = errNotRegistered.Error()
	case cmd.Epoch < a.maxEpoch:
		reply.Error = fmt.Sprintf("stale epoch %d: have seen %d", cmd.Epoch, a.maxEpoch)
	case cmd.Incarnation != a.incarnation:
		reply.Error = fmt.Sprintf("command for incarnation %s, this is %s", cmd.Incarnation, a.incarnation)
	}
	if reply.Error != "" {
		reply.Epoch = a.maxEpoch
		a.mu.Unlock()
		a.stats.Refused.Add(1)
		a.limit.log(a.log, "refused-command", "refused a command", "kind", cmd.Kind, "epoch", cmd.Epoch, "why", reply.Error)
		a.answer(m, reply)
		return
	}
	a.maxEpoch = cmd.Epoch
	reply.Epoch = cmd.Epoch

	// later, when set, finishes the command in a goroutine and completes
	// its answer.
	var later func(r *protocol.Reply)
	switch cmd.Kind {
	case protocol.CmdBind:
		err = a.bindShardsLocked(cmd)
	case protocol.CmdDrop:
		if dropped := a.unbindLocked(cmd.Shards, "dropped by the coordinator"); len(dropped) > 0 {
			a.log.Info("dropped shards", "shards", dropped, "epoch", cmd.Epoch)
		}
	case protocol.CmdHandOff:
		reply.Complete, reply.Replaying, later = a.handOffLocked(cmd)
	case protocol.CmdRelease:
		later, err = a.releaseLocked(cmd)
	case protocol.CmdLeave:
		later = a.leaveLocked()
	}
	reply.Held = a.heldLocked()
	if cmd.Kind == protocol.CmdProbe {
		reply.Load = a.probeLoadLocked()
	}
	if later == nil || err != nil {
		a.mu.Unlock()
		if err != nil {
			reply.Error = err.Error()
		}
		a.answer(m, reply)
		return
	}
	a.wg.Add(1) // under a.mu, so before Close can wait
	a.mu.Unlock()
	go func() {
		defer a.wg.Done()
		later(&reply)
		reply.Held = a.Held()
		a.answer(m, reply)
	}()
}

// epochCheckTimeout bounds the read of the coordinator lease that checks a
// new epoch.
const epochCheckTimeout = 5 * time.Second

// checkEpoch accepts an epoch newer than any the region has seen only if
// it is the coordinator lease's, read from the stream leader: a holder of
// region credentials (who may publish on the control subjects) could
// otherwise forge a command with a high epoch, which the region would obey
// and then refuse every command of the real coordinator as stale, and
// the coordinator would step down. The lease is read once per new epoch.
func (a *Agent) checkEpoch(epoch uint64) error {
	a.mu.Lock()
	seen := a.maxEpoch
	a.mu.Unlock()
	if epoch <= seen {
		return nil // seen already, or stale (refused below)
	}
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

func (a *Agent) answer(m *nats.Msg, r protocol.Reply) {
	if m.Reply == "" {
		return
	}
	data, err := protocol.Encode(r)
	if err == nil {
		err = m.Respond(data)
	}
	if err != nil {
		a.log.Debug("cannot answer a command", "err", err)
	}
}

// bindShardsLocked binds the shards that are not held yet, each to be
// replayed up to its handoff's end marker; a shard already held (live or
// replaying) is left as it is. It flushes so that the server knows the
// subscriptions before the coordinator hears that they exist. a.mu is
// held.
func (a *Agent) bindShardsLocked(cmd protocol.Command) error {
	for _, n := range cmd.Shards {
		if st := a.shards[n]; st != nil && st.currentMode() == modeDivert {
			return fmt.Errorf("bind of shard %d refused: it is paused for a handoff here; release or drop it first", n)
		}
	}
	var added []int
	for i, n := range cmd.Shards {
		if _, ok := a.shards[n]; ok {
			continue
		}
		if err := a.bindLocked(n, cmd.Handoffs[i]); err != nil {
			return err
		}
		added = append(added, n)
	}
	if err := a.cfg.Conn.Flush(); err != nil {
		return fmt.Errorf("flush subscriptions: %w", err)
	}
	if len(added) > 0 {
		a.log.Info("bound shards; replaying their buffers", "shards", added, "handoffs", cmd.Handoffs, "epoch", cmd.Epoch)
	}
	return nil
}

// handOffLocked pauses the command's live shards (DESIGN.md 6, step 2):
// from now on their arrivals go to the buffer and their entities stop. It
// reports whether every entity of the shards has stopped already; if not,
// later waits up to HandOffWait for them and sets Complete. A shard that
// is still replaying is left alone, reported in replaying, and makes the
// answer incomplete (the coordinator asks again). A shard not held has
// nothing to stop. A repeated HandOff restarts nothing. a.mu is held.
func (a *Agent) handOffLocked(cmd protocol.Command) (complete bool, replaying []int, later func(r *protocol.Reply)) {
	var (
		waits  []<-chan struct{}
		paused []int
	)
	for i, n := range cmd.Shards {
		st := a.shards[n]
		if st == nil {
			continue
		}
		h := cmd.Handoffs[i]
		st.mu.Lock()
		switch st.mode {
		case modeHold:
			replaying = append(replaying, n)
		case modeLive:
			a.pauseLocked(st, h)
			paused = append(paused, n)
		case modeDivert:
			if st.handoff != h {
				a.log.Info("shard already paused under another handoff id", "shard", n, "was", st.handoff, "now", h)
				st.handoff = h
			}
		}
		if st.mode == modeDivert {
			waits = append(waits, st.stopped)
		}
		st.mu.Unlock()
	}
	if len(paused) > 0 {
		a.log.Info("paused shards for handoff: buffering their messages", "shards", paused, "epoch", cmd.Epoch)
	}
	switch {
	case len(replaying) > 0:
		return false, replaying, nil
	case allClosed(waits):
		return true, nil, nil
	}
	return false, nil, func(r *protocol.Reply) {
		t := time.NewTimer(a.cfg.HandOffWait)
		defer t.Stop()
		for _, ch := range waits {
			select {
			case <-ch:
			case <-t.C:
				return // Complete stays false
			case <-a.ctx.Done():
				r.Error = ErrClosed.Error()
				return
			}
		}
		r.Complete = true
	}
}

func allClosed(chs []<-chan struct{}) bool {
	for _, ch := range chs {
		select {
		case <-ch:
		default:
			return false
		}
	}
	return true
}

// releaseLocked ends the source's part of a handoff (DESIGN.md 6, step 5)
// for the command's shards. It refuses the whole command, changing
// nothing, when one of them is live or replaying here (the coordinator
// releases only a shard it paused). later keeps the paused shards
// diverting for ReleaseGrace, then drains their subscriptions (every
// message already received is buffered), forgets them, and appends the
// end marker of each shard's handoff. A shard not held here gets its end
// marker all the same (harmless when it is already there), so that a new
// owner never waits for it forever. A repeated Release joins the one under
// way. a.mu is held.
func (a *Agent) releaseLocked(cmd protocol.Command) (later func(r *protocol.Reply), err error) {
	for _, n := range cmd.Shards {
		if st := a.shards[n]; st != nil {
			if md := st.currentMode(); md != modeDivert {
				return nil, fmt.Errorf("release of shard %d refused: it is %s here, not paused for a handoff", n, md)
			}
		}
	}
	type job struct {
		n       int
		handoff uint64
		st      *shardState   // nil: not held
		drain   bool          // this release drains st
		done    chan struct{} // closed when st is unsubscribed
	}
	jobs := make([]job, len(cmd.Shards))
	grace := false
	for i, n := range cmd.Shards {
		j := job{n: n, handoff: cmd.Handoffs[i], st: a.shards[n]}
		if j.st != nil {
			if j.st.released == nil {
				j.st.released = make(chan struct{})
				j.drain, grace = true, true
			}
			j.done = j.st.released
		}
		jobs[i] = j
	}
	return func(r *protocol.Reply) {
		if grace && !wait.Sleep(a.ctx, a.cfg.ReleaseGrace) {
			r.Error = ErrClosed.Error()
			return
		}
		for _, j := range jobs {
			if j.drain {
				a.wg.Add(1)
				go func() {
					defer a.wg.Done()
					a.drainReleased(j.st)
					close(j.done)
				}()
			}
		}
		var errs []error
		for _, j := range jobs {
			if j.done != nil {
				select {
				case <-j.done:
				case <-a.ctx.Done():
					r.Error = ErrClosed.Error()
					return
				}
			}
			if _, err := a.cfg.Buffer.Mark(a.ctx, j.n, j.handoff); err != nil {
				errs = append(errs, fmt.Errorf("end marker of shard %d: %w", j.n, err))
			}
		}
		if err := errors.Join(errs...); err != nil {
			a.log.Warn("release: cannot append end markers; the coordinator will ask again", "err", err)
			r.Error = err.Error()
			return
		}
		a.log.Info("released shards: end markers written", "shards", cmd.Shards, "handoffs", cmd.Handoffs, "epoch", cmd.Epoch)
	}, nil
}

// drainReleased unsubscribes a released shard so that every message its
// subscription received before the server removed the interest is still
// buffered, then forgets the shard.
func (a *Agent) drainReleased(st *shardState) {
	if err := drain.Subscription(a.ctx, st.sub, drainTimeout); err != nil && a.ctx.Err() == nil {
		a.log.Warn("a released shard's subscription did not drain; cut", "shard", st.n, "err", err)
	}
	a.mu.Lock()
	a.forgetLocked(st)
	a.mu.Unlock()
}

// leaveLocked marks the region leaving; later writes the registration
// with the flag at once (every renewal after carries it too). a.mu is
// held.
func (a *Agent) leaveLocked() (later func(r *protocol.Reply)) {
	if !a.leaving {
		a.log.Info("region leaving, as the coordinator asked")
	}
	a.leaving = true
	return func(r *protocol.Reply) {
		if err := a.renew(a.ctx); err != nil {
			r.Error = fmt.Sprintf("cannot write the leaving registration: %v", err)
		}
	}
}
