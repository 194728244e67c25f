package region

import (
	"time"

	"github.com/natshard/natshard/region/internal/host"
)

// Timers of entities (Akka's withTimers, Orleans' RegisterTimer): an
// active entity arms a named timer; when it fires, a message goes into the
// entity's own mailbox (no NATS hop) and Handle gets it in the entity's
// turn, with Message.Timer() == name. The entity runtime keeps them
// (internal/host, timers.go).

// Errors of StartTimer.
var (
	// ErrNotActive: the entity is not active in this region, or is being
	// stopped (its Stop hook runs, or its shard is being stopped): a timer
	// is armed by the entity itself, from its Factory or Handle.
	ErrNotActive = host.ErrNotActive
	// ErrTimerName: a timer's name is empty.
	ErrTimerName = host.ErrTimerName
)

// StartTimer arms (or re-arms: a reset) the timer name of entity id of
// shard, which must be active here: called by the entity, from its
// Factory or Handle. After d, and when periodic every d after each of its
// messages was handled, the entity's Handle gets a message with data and
// Message.Timer() == name, through its own mailbox, in its turn. The
// timer is cancelled when the entity stops (passivation, its shard's
// handoff, drop or fence) and lost with the activation: a durable
// reminder survives moves and crashes. It returns ErrNotActive when the
// entity is not active here.
func (a *Agent) StartTimer(shard int, id, name string, d time.Duration, periodic bool, data []byte) error {
	return a.host.StartTimer(shard, id, name, d, periodic, data)
}

// CancelTimer cancels the timer name of entity id of shard: its message
// never reaches Handle, even one queued already. It reports whether the
// timer was armed.
func (a *Agent) CancelTimer(shard int, id, name string) bool {
	return a.host.CancelTimer(shard, id, name)
}

// TimerActive reports whether the timer name of entity id of shard is
// armed, or its message queued and not handled yet.
func (a *Agent) TimerActive(shard int, id, name string) bool {
	return a.host.TimerActive(shard, id, name)
}
