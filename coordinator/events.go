package coordinator

import "github.com/natshard/natshard/protocol"

// Event is an input to Core.Step. The driver turns what it sees (KV
// watches, command replies) into events.
type Event interface{ isEvent() }

// RegionSeen is a registered region with the revision of its registration.
type RegionSeen struct {
	Info     protocol.RegionInfo
	Revision uint64
}

// RegionUp: a region registered, renewed or changed its registration.
type RegionUp struct{ RegionSeen }

// RegionGone: a region's registration expired or was removed.
type RegionGone struct{ ID string }

// RegionsSynced: after a (re)started watch, these are all the registered
// regions; any other is gone.
type RegionsSynced struct{ IDs []string }

// ConnClosed: a NATS server reports that this client connection closed
// (Config.Disconnects). The region it belonged to is probed at once, and
// again at the next tick: the probe is the proof. ByClient: the client's
// end closed or reset it (see Disconnect), so that the first "no
// responders" removes the region without waiting for Silence.
type ConnClosed Disconnect

// Outcome classifies the answer to a command.
type Outcome int

// Outcomes of a command.
const (
	// OK: the region answered without error.
	OK Outcome = iota
	// NoResponders: nobody listens on the region's command subject: the
	// region's connection is gone from the servers (it may be
	// reconnecting: see CoreConfig.Silence).
	NoResponders
	// Failed: a timeout or transport error: the region may still be there.
	Failed
	// Refused: the region answered with an error (Reply.Error).
	Refused
)

// CommandDone reports how a command sent by a Send action ended.
type CommandDone struct {
	Send    Send
	Outcome Outcome
	Reply   protocol.Reply // when Outcome is OK or Refused
}

// Unparked: the driver finished an Unpark: it stopped diverting the shard
// and appended the end marker Handoff.
type Unparked struct {
	Shard   int
	Handoff uint64
}

// Marked: the driver appended the end marker Handoff to the shard's buffer
// on behalf of a source that died.
type Marked struct {
	Shard   int
	Handoff uint64
}

func (RegionUp) isEvent()      {}
func (RegionGone) isEvent()    {}
func (RegionsSynced) isEvent() {}
func (ConnClosed) isEvent()    {}
func (CommandDone) isEvent()   {}
func (Unparked) isEvent()      {}
func (Marked) isEvent()        {}

// Action is an output of Core: something the driver must do, in order.
type Action interface{ isAction() }

// WriteShard: write the row to the shard table, fenced on the lease. A
// failed write means the coordinator must step down.
type WriteShard struct{ Record protocol.ShardRecord }

// Send: send the command to the region's command subject and report the
// outcome with a CommandDone event. Sends may run concurrently.
type Send struct {
	Region   string
	Command  protocol.Command
	At       int    // the core's tick when the command was decided
	Revision uint64 // the region's registration revision then
}

// RemoveRegion: delete the region's registration if it is still at
// Revision: the region was found dead. The core forgets the region, and
// rescues its shards, when the watch of the registrations reports it gone
// (RegionGone), that is only once the removal succeeded: a region that
// renewed its registration since (back from a reconnect) keeps it and its
// shards.
type RemoveRegion struct {
	ID       string
	Revision uint64
}

// StepDown: this coordinator learned that a newer epoch exists.
type StepDown struct{ Reason string }

// Park: subscribe to the shard's subject and divert what arrives to its
// buffer (the coordinator holds the shard until an owner binds).
// Idempotent. Fence, when not 0, is the handoff id of a source the shard
// is taken from without its consent: the buffer is fenced on it
// (kvstate.Buffer.Fence) before anything is diverted, so that what that
// source appends from then on is never replayed.
//
// Adopt: start no parking; only adopt the shard's parking if this process
// still runs it for an earlier term (renaming it to Handoff and this
// term). A new coordinator that finds a shard binding from parking to a
// live region parks so (Core.takeOver): the region may be holding what
// arrives already, and a new parking's appends, replayed before what it
// held, would put newer messages before older ones.
type Park struct {
	Shard   int
	Handoff uint64
	Fence   uint64
	Adopt   bool
}

// Unpark: keep diverting for the grace period, unsubscribe, append the end
// marker Handoff, then report Unparked. Live: the new owner was serving the
// shard live already when it confirmed the bind (a coordinator that took
// over parked a shard whose owner had gone live under its predecessor), so
// what was diverted is a copy of what it handled: the buffer is purged
// instead of marked, or the shard's next owner would replay the copies.
type Unpark struct {
	Shard   int
	Handoff uint64
	Live    bool
}

// Mark: append the end marker Handoff to the shard's buffer (its source
// died before it could), then report Marked. Fence: fence Handoff first
// (see Park): the source was found gone, but may be a frozen process that
// wakes up.
type Mark struct {
	Shard   int
	Handoff uint64
	Fence   bool
}

// WriteConfig: write the type's configuration, fenced on the lease: a
// split's commit (Config.To set) or announce (docs/PROTOCOL.md,
// Resharding). The table writes before it are written first. A failed
// write means the coordinator must step down.
type WriteConfig struct{ Config protocol.TypeConfig }

// Warn: something an operator should see (a handoff timed out).
type Warn struct{ Msg string }

// WritePin: write the shard's pin to KV, fenced on the lease (Region ""
// removes it). A failed write means the coordinator must step down.
type WritePin struct {
	Shard  int
	Region string
}

// RoundPlanned: a rebalance round planned Moves (in the order they start;
// To is where the strategy places each now), with Regions holding these
// many shards before it. For the operators' log.
type RoundPlanned struct {
	Round   int
	Moves   []protocol.PlannedMove
	Regions map[string]int
}

// RoundDone: every move of the round has ended. Moved moves were started;
// Dropped planned moves were not, for Reason.
type RoundDone struct {
	Round, Moved, Dropped int
	Reason                string
}

// NoRound: a rebalance round was due but runs no moves, for Reason
// (reported when the reason changes). Settling is the wait for membership
// to settle after a change, which ends by itself within the settle ticks
// (logged at DEBUG: the round or the reason that follows it is INFO).
type NoRound struct {
	Reason   string
	Settling bool
}

func (WriteShard) isAction()   {}
func (RoundPlanned) isAction() {}
func (RoundDone) isAction()    {}
func (NoRound) isAction()      {}
func (Send) isAction()         {}
func (RemoveRegion) isAction() {}
func (StepDown) isAction()     {}
func (Park) isAction()         {}
func (Unpark) isAction()       {}
func (Mark) isAction()         {}
func (Warn) isAction()         {}
func (WritePin) isAction()     {}
func (WriteConfig) isAction()  {}
