package natshard

import (
	"errors"
	"time"
)

// Timers of an entity (Akka's withTimers, Orleans' RegisterTimer): in
// memory, in the entity's turn, in every delivery mode. See
// docs/GUIDE.md "Timers and reminders" for when to use a durable
// reminder (Env.Remind) instead.

// errNoTimers: the Env is not a hosted entity's (a test's own Env).
var errNoTimers = errors.New("natshard: timers need a hosted entity's Env")

// StartTimer arms the entity's timer name, or re-arms it if it is armed
// already (a reset: the earlier arming's message never comes, even one
// queued already). After d, Handle gets a message with data and
// Message.Timer() == name (no subject, reply or header). The message goes
// through the entity's own mailbox, not NATS: Handle gets it in the
// entity's turn, one at a time with the entity's other messages, as any
// message. A timer lives with the activation: it is cancelled when the
// entity passivates or its shard leaves the process (a move, a drop, a
// fence, a crash), and never fires after that; a durable reminder
// (Remind) survives those. Its message counts as activity for IdleTimeout.
// Call it from the entity's Factory or Handle.
func (e *Env) StartTimer(name string, d time.Duration, data []byte) error {
	return e.startTimer(name, d, false, data)
}

// StartPeriodicTimer is StartTimer for a timer that comes again every
// interval after each of its messages was handled (a fixed delay: a slow
// entity never gets a pile of them), until cancelled. An entity with a
// periodic timer shorter than IdleTimeout never passivates for idleness.
func (e *Env) StartPeriodicTimer(name string, interval time.Duration, data []byte) error {
	return e.startTimer(name, interval, true, data)
}

func (e *Env) startTimer(name string, d time.Duration, periodic bool, data []byte) error {
	if e.h == nil || e.h.agent == nil {
		return errNoTimers
	}
	return e.h.agent.StartTimer(e.Shard, e.ID, name, d, periodic, data)
}

// CancelTimer cancels the entity's timer name: its message never reaches
// Handle, even one queued already. It reports whether the timer was
// armed (or its message queued).
func (e *Env) CancelTimer(name string) bool {
	if e.h == nil || e.h.agent == nil {
		return false
	}
	return e.h.agent.CancelTimer(e.Shard, e.ID, name)
}

// TimerActive reports whether the entity's timer name is armed, or its
// message queued and not handled yet.
func (e *Env) TimerActive(name string) bool {
	if e.h == nil || e.h.agent == nil {
		return false
	}
	return e.h.agent.TimerActive(e.Shard, e.ID, name)
}
