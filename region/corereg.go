package region

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/natshard/natshard/internal/renewal"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// The registration life cycle of the Core: register, renew, fence,
// suspend, confirm, register again, leave. The core decides; the driver
// writes (Register, Renew), reads (ReadTable) and reports back
// (RegisterDone, RenewDone, Confirmed). Time comes in with Tick and with
// those reports; deadlines are package renewal's. One registration write
// is in flight at a time: a write asked for meanwhile (a leave, an
// undrain, a confirmation) follows the one in flight.
//
//	unregistered --Register/RegisterDone ok--> registered
//	registered --Renew/RenewDone conflict, or the deadline passed, or Fenced--> unregistered
//	registered --Suspended--> suspended --Reconnected: Renew, ReadTable, Confirmed--> registered
//	unregistered --RegisterDone ErrRegionInUse--> failed (for good)

// registration is the core's view of its registration.
type registration struct {
	now       time.Time     // the newest time the core was told
	lease     kvstate.Lease // of the registration written last
	started   int64         // unix ms of the incarnation's first registration
	renewedAt time.Time     // when the last successful write was sent
	due       time.Time     // when the next renewal (or registration) is due

	// pending is the incarnation being registered: a registration whose
	// answer did not come may be stored later still, so retries reuse it
	// rather than announcing yet another one.
	pending        string
	pendingStarted int64
	opening        bool // the first registration, which Open waits for (Opened)
	lateAcks       int  // the first registration's late acknowledgements
	failed         bool // never registers again (Fail, or Opened with an error)

	writes  uint64   // counts write tokens
	writing uint64   // the token of the write in flight; 0: none
	again   bool     // write again once the one in flight ends
	waiting []waiter // told the outcome of the write in flight
	next    []waiter // told the outcome of the next write

	// drops counts the Suspended events, so that a confirmation that a
	// drop overtook is made again.
	drops   uint64
	confirm confirmPhase
	retryAt time.Time     // confirmRetry: when to start the next round
	backoff time.Duration // of the confirmation rounds

	left     []chan struct{} // Leaving: closed once no shard is held
	quiet    chan struct{}   // Closing: closed once no write is in flight
	failWith error           // the error of Fail, for Failed
}

// waiter is told the outcome of a registration write: the answer to
// command id, or a channel to close, or the confirmation under way.
type waiter struct {
	id      uint64
	done    chan struct{}
	confirm bool
}

// confirmPhase is where a confirmation after a reconnect stands.
type confirmPhase uint8

const (
	confirmNone  confirmPhase = iota
	confirmWrite              // waiting for a renewal written after the reconnect
	confirmRead               // ReadTable sent
	confirmRetry              // waiting for retryAt
)

// errLateAck: a registration was acknowledged after the renewal deadline;
// it is written again, as the same incarnation.
var errLateAck = errors.New("registration acknowledged too late")

// errNotRegistered: the region has no registration to renew (fenced; it
// registers a new incarnation).
var errNotRegistered = errors.New("region is not registered")

// maxLateAcks bounds the late acknowledgements of the first registration
// before Open gives up.
const maxLateAcks = 3

// RegisterDone: a Register action ended. Sent is when the write was sent,
// At when its answer came; Err may wrap ErrRegionInUse (the take-over
// check found another process answering for the region id).
type RegisterDone struct {
	Token    uint64
	Lease    kvstate.Lease
	Sent, At time.Time
	Err      error
}

// RenewDone: a Renew action ended. Conflict: the registration was not
// the one renewed (removed by the coordinator, or taken over); Canceled:
// the agent stopped waiting for it (no verdict).
type RenewDone struct {
	Token              uint64
	Lease              kvstate.Lease
	Sent, At           time.Time
	Err                error
	Conflict, Canceled bool
}

// Reconnected: the connection to NATS is back; a suspended region
// confirms its shards.
type Reconnected struct{}

func (RegisterDone) isEvent() {}
func (RenewDone) isEvent()    {}
func (Reconnected) isEvent()  {}

// Register: write a new registration, Info, with a TTL of TTL (after
// checking, when CheckTakeover, that no other process took the region id
// over); report RegisterDone with Token. The driver fills Info.Conn.
type Register struct {
	Token         uint64
	Info          protocol.RegionInfo
	TTL           time.Duration
	CheckTakeover bool
}

// Renew: rewrite the registration at Lease's revision with Info and a
// fresh TTL, giving up at Deadline; report RenewDone with Token. The
// driver fills Info.Conn.
type Renew struct {
	Token    uint64
	Lease    kvstate.Lease
	Info     protocol.RegionInfo
	Deadline time.Time
}

// ReadTable: read the shard table from the stream leader and report
// Confirmed with Incarnation, Drops and the rows (an error if the
// connection is down again).
type ReadTable struct {
	Incarnation string
	Drops       uint64
}

// Opened: the first registration ended (Err nil: registered).
type Opened struct{ Err error }

// Fail: the region stops for good (another live process registered
// under its id).
type Fail struct{ Err error }

// Signal: close Ch (someone waits for it: Leaving, Closing).
type Signal struct{ Ch chan struct{} }

// Count: add one to a counter of Stats.
type Count struct{ What counter }

// counter names a counter of Stats that the core counts.
type counter uint8

const (
	countFenced counter = iota
	countSuspended
	countConfirmed
	countRenewalFailed
)

func (Register) isAction()  {}
func (Renew) isAction()     {}
func (ReadTable) isAction() {}
func (Opened) isAction()    {}
func (Fail) isAction()      {}
func (Signal) isAction()    {}
func (Count) isAction()     {}

// Start begins the first registration of a core made unregistered (an
// incarnation of "" in NewCore): it returns the Register action; Opened
// tells how it ended.
func (c *Core) Start(now time.Time) []Action {
	c.out = nil
	c.later(now)
	c.reg.opening = true
	c.register()
	return c.out
}

// Registered reports whether the region has a registration.
func (c *Core) Registered() bool { return c.registered }

// Suspended reports whether the region is suspended (see Suspended).
func (c *Core) Suspended() bool { return c.suspended }

// Closed reports whether the region is closing.
func (c *Core) Closed() bool { return c.closed }

// Incarnation is the incarnation registered last.
func (c *Core) Incarnation() string { return c.incarnation }

// Lease is the registration's lease as written last.
func (c *Core) Lease() kvstate.Lease { return c.reg.lease }

// Deadline is when the region must have stopped serving if it has not
// renewed its registration since (renewal.Deadline); zero when it has no
// registration, or no lease TTL.
func (c *Core) Deadline() time.Time {
	if !c.registered || c.cfg.LeaseTTL <= 0 {
		return time.Time{}
	}
	return renewal.Deadline(c.reg.renewedAt, c.cfg.LeaseTTL)
}

// Writing reports whether a registration write is in flight.
func (c *Core) Writing() bool { return c.reg.writing != 0 }

// later moves the core's time on to t (never back).
func (c *Core) later(t time.Time) {
	if t.After(c.reg.now) {
		c.reg.now = t
	}
}

// info is the registration's value now.
func (c *Core) info(inc string, started int64) protocol.RegionInfo {
	return protocol.RegionInfo{ID: c.cfg.Region, Incarnation: inc, Version: c.cfg.Version, Leaving: c.leaving, Started: started, Instance: c.cfg.Instance}
}

// tickRegistration renews when due, fences past the deadline, registers
// again when due, and starts a confirmation round when its retry is due.
func (c *Core) tickRegistration() {
	if c.cfg.LeaseTTL <= 0 || c.closed || c.reg.failed {
		return
	}
	now := c.reg.now
	switch {
	case c.registered && !now.Before(c.Deadline()) && c.reg.writing == 0:
		c.fence("cannot renew the registration in time")
	case c.registered && !now.Before(c.Deadline()):
		// A renewal is in flight (bounded by the deadline) or its answer
		// waits in the driver's queue: serve nothing until it is known,
		// and then confirm the shards, as after a stall (stall.go).
		if !c.suspended && !c.cfg.ServeOnAtDeadline {
			c.onSuspended(Suspended{Reason: "registration deadline passed with a renewal unanswered"})
			c.reconnected()
		}
	case c.reg.writing != 0 || now.Before(c.reg.due):
	case c.registered:
		c.renew()
	case !c.reg.opening:
		c.register()
	}
	if c.reg.confirm == confirmRetry && !now.Before(c.reg.retryAt) {
		c.startConfirm()
	}
}

// register sends the registration of the pending incarnation (a new one
// unless a registration is pending).
func (c *Core) register() {
	if c.reg.pending == "" {
		c.reg.pending, c.reg.pendingStarted = c.cfg.NewIncarnation(), c.reg.now.UnixMilli()
	}
	c.reg.writes++
	c.reg.writing = c.reg.writes
	c.emit(Register{Token: c.reg.writing, Info: c.info(c.reg.pending, c.reg.pendingStarted), TTL: c.cfg.LeaseTTL, CheckTakeover: !c.reg.opening})
}

// renew sends a renewal of the registration.
func (c *Core) renew() {
	c.reg.writes++
	c.reg.writing = c.reg.writes
	c.emit(Renew{Token: c.reg.writing, Lease: c.reg.lease, Info: c.info(c.incarnation, c.reg.started), Deadline: renewal.AttemptDeadline(c.reg.renewedAt, c.reg.now, c.cfg.LeaseTTL)})
}

// write asks for a write of the registration as it is now; w is told
// its outcome.
func (c *Core) write(w waiter) {
	switch {
	case c.closed:
		c.written(w, ErrClosed)
	case !c.registered:
		c.written(w, errNotRegistered)
	case c.reg.writing != 0:
		c.reg.again = true
		c.reg.next = append(c.reg.next, w)
	default:
		c.reg.waiting = append(c.reg.waiting, w)
		c.renew()
	}
}

// written tells w the outcome of its write.
func (c *Core) written(w waiter, err error) {
	switch {
	case w.confirm:
		if c.reg.confirm != confirmWrite {
			return
		}
		if err != nil {
			c.retryConfirm(err)
			return
		}
		c.reg.confirm = confirmRead
		c.emit(ReadTable{Incarnation: c.incarnation, Drops: c.reg.drops})
	case w.done != nil:
		if err != nil {
			c.log(slog.LevelWarn, "cannot write the leaving registration now; the next renewal will", "err", err)
		}
		c.emit(Signal{Ch: w.done})
	case w.id != 0:
		r := protocol.Reply{Incarnation: c.incarnation, Epoch: c.maxEpoch, Held: c.held()}
		if err != nil {
			r.Error = err.Error()
		}
		c.emit(Answer{ID: w.id, Reply: r})
	case err != nil:
		c.log(slog.LevelWarn, "cannot write the registration now; the next renewal will", "err", err)
	}
}

// failWrites tells every waiter of a write err (fenced, closing).
func (c *Core) failWrites(err error) {
	ws := append(c.reg.waiting, c.reg.next...)
	c.reg.waiting, c.reg.next, c.reg.again = nil, nil, false
	for _, w := range ws {
		c.written(w, err)
	}
}

// registerDone takes the outcome of a registration.
func (c *Core) registerDone(ev RegisterDone) {
	if ev.Token == 0 || ev.Token != c.reg.writing {
		return
	}
	c.reg.writing = 0
	c.later(ev.At)
	err := ev.Err
	if err == nil && !ev.At.Before(renewal.Deadline(ev.Sent, c.cfg.LeaseTTL)) {
		// Acknowledged so late that the rule counts it expired already:
		// written again, as the same incarnation.
		err = fmt.Errorf("region: register %s: %w (%s after it was sent)", c.cfg.Region, errLateAck, ev.At.Sub(ev.Sent).Round(time.Millisecond))
	}
	switch {
	case errors.Is(err, ErrRegionInUse):
		c.reg.failed, c.reg.failWith = true, err
		c.emit(Fail{Err: err})
		if c.reg.opening {
			c.emit(Opened{Err: err})
		}
	case err != nil && c.reg.opening:
		if c.reg.lateAcks++; errors.Is(err, errLateAck) && c.reg.lateAcks < maxLateAcks && !c.closed {
			c.register()
			break
		}
		c.reg.failed, c.reg.failWith = true, err
		c.emit(Opened{Err: err})
	case err != nil:
		c.log(slog.LevelWarn, "cannot register; retrying", "err", err)
		c.reg.due = c.reg.now.Add(min(renewal.Retry, renewal.Interval(c.cfg.LeaseTTL)))
	default:
		c.registered, c.incarnation, c.suspended = true, c.reg.pending, false
		c.reg.started, c.reg.lease, c.reg.renewedAt = c.reg.pendingStarted, ev.Lease, ev.Sent
		c.reg.pending, c.reg.confirm = "", confirmNone
		c.reg.due = ev.Sent.Add(renewal.Interval(c.cfg.LeaseTTL))
		if c.reg.opening {
			c.reg.opening = false
			c.emit(Opened{})
		} else {
			c.log(slog.LevelInfo, "registered as a new incarnation", "incarnation", c.incarnation)
		}
	}
	c.quietCheck()
}

// renewDone takes the outcome of a renewal: it fences the region when the
// registration was lost, or could not be renewed before its deadline.
func (c *Core) renewDone(ev RenewDone) {
	if ev.Token == 0 || ev.Token != c.reg.writing {
		return
	}
	c.reg.writing = 0
	c.later(ev.At)
	waiting := c.reg.waiting
	c.reg.waiting = nil
	if c.registered {
		if ev.Err != nil && !ev.Canceled {
			c.emit(Count{What: countRenewalFailed})
		}
		switch {
		case ev.Err == nil:
			c.reg.lease, c.reg.renewedAt = ev.Lease, ev.Sent
			c.reg.due = ev.Sent.Add(renewal.Interval(c.cfg.LeaseTTL))
		case ev.Canceled:
			// The agent stopped waiting (Close): no verdict.
		case ev.Conflict:
			c.fence("registration lost (removed by the coordinator, or taken over)")
		case c.cfg.LeaseTTL > 0 && !ev.At.Before(c.Deadline()):
			c.fence(fmt.Sprintf("cannot renew the registration in time: %v", ev.Err))
		default:
			// A full JetStream store refuses every renewal, retried
			// every 250 ms: the driver limits the log lines.
			c.emit(Log{Level: slog.LevelWarn, Msg: "registration renewal failed; will retry", Args: []any{"err", ev.Err}, Limit: "renew-failed"})
			c.reg.due = ev.At.Add(min(renewal.Retry, renewal.Interval(c.cfg.LeaseTTL)))
		}
	}
	for _, w := range waiting {
		c.written(w, ev.Err)
	}
	if c.reg.again && c.registered && !c.closed {
		c.reg.again = false
		c.reg.waiting, c.reg.next = c.reg.next, nil
		c.renew()
	}
	c.quietCheck()
}

// fence stops serving every shard at once and forgets the registration;
// the next tick registers a new incarnation, which starts with no shard.
func (c *Core) fence(reason string) {
	if !c.registered {
		return
	}
	c.registered, c.suspended = false, false
	c.reg.confirm = confirmNone
	c.reg.due = c.reg.now
	c.emit(Count{What: countFenced})
	dropped := c.unbindAll("region fenced")
	c.log(slog.LevelWarn, "fenced: stopped serving every shard", "reason", reason, "shards", len(dropped))
	c.failWaiting(errNotRegistered)
	c.failWrites(errNotRegistered)
}

// suspended: the connection dropped (see Suspended).
func (c *Core) onSuspended(ev Suspended) {
	if !c.registered || c.closed || ev.Incarnation != "" && ev.Incarnation != c.incarnation {
		return
	}
	c.reg.drops++
	if c.suspended {
		return
	}
	c.emit(Count{What: countSuspended})
	c.suspend(ev)
}

// reconnected starts a confirmation of a suspended region's shards.
func (c *Core) reconnected() {
	if c.suspended && c.registered && !c.closed && (c.reg.confirm == confirmNone || c.reg.confirm == confirmRetry) {
		c.reg.backoff = 0
		c.startConfirm()
	}
}

// startConfirm starts a confirmation round: a renewal written after now
// (naming the new connection), then a read of the shard table; the round
// stands if no drop came in between (Confirmed).
func (c *Core) startConfirm() {
	c.reg.confirm = confirmWrite
	c.write(waiter{confirm: true})
}

// retryConfirm schedules the next confirmation round.
func (c *Core) retryConfirm(err error) {
	if !c.suspended || !c.registered || c.closed {
		c.reg.confirm = confirmNone
		return
	}
	if c.reg.backoff == 0 {
		c.reg.backoff = wait.RetryFirst
	} else {
		c.reg.backoff = wait.Next(c.reg.backoff)
	}
	c.reg.confirm, c.reg.retryAt = confirmRetry, c.reg.now.Add(c.reg.backoff)
	c.emit(Log{Level: slog.LevelWarn, Msg: "cannot confirm the shards after the reconnect yet; retrying", Args: []any{"err", err}, Limit: "confirm-failed"})
}

// confirmedEv takes the outcome of a confirmation round's table read.
func (c *Core) confirmedEv(ev Confirmed) {
	if !c.suspended || ev.Incarnation != c.incarnation {
		return
	}
	switch {
	case ev.Err != nil:
		c.retryConfirm(ev.Err)
	case ev.Drops != c.reg.drops:
		c.retryConfirm(errors.New("the connection dropped again meanwhile"))
	default:
		c.reg.confirm, c.reg.backoff = confirmNone, 0
		c.emit(Count{What: countConfirmed})
		c.confirmed(ev)
	}
}

// leavingEv: the process is stopping (Agent.Leave).
func (c *Core) leavingEv(ev Leaving) {
	if c.closed {
		if ev.Written != nil {
			c.emit(Signal{Ch: ev.Written})
		}
		if ev.Done != nil {
			c.emit(Signal{Ch: ev.Done})
		}
		return
	}
	if !c.leaving {
		c.log(slog.LevelInfo, "region leaving: waiting for its shards to be handed off")
	}
	c.leaving, c.going = true, true
	c.write(waiter{done: ev.Written})
	if ev.Done != nil {
		c.reg.left = append(c.reg.left, ev.Done)
	}
}

// closingEv: the region closes.
func (c *Core) closingEv(ev Closing) {
	if !c.closed {
		c.closed = true
		c.unbindAll("region closing")
		c.failWaiting(ErrClosed)
		c.failWrites(ErrClosed)
	}
	if ev.Done != nil {
		c.reg.quiet = ev.Done
	}
	c.quietCheck()
}

// quietCheck signals a closing region's Close once no write is in flight.
func (c *Core) quietCheck() {
	if c.reg.quiet != nil && c.reg.writing == 0 {
		c.emit(Signal{Ch: c.reg.quiet})
		c.reg.quiet = nil
	}
}

// leftCheck signals the Leave calls waiting once no shard is held.
func (c *Core) leftCheck() {
	if len(c.reg.left) == 0 || len(c.shards) > 0 {
		return
	}
	for _, ch := range c.reg.left {
		c.emit(Signal{Ch: ch})
	}
	c.reg.left = nil
}
