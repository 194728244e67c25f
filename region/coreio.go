package region

// The core's inputs (events, Core.Step) and outputs (actions, which the
// driver carries out in order): moved out of core.go, which holds how
// the core decides.

import (
	"log/slog"

	"github.com/natshard/natshard/protocol"
)

// Event is an input of Core.Step.
type Event interface{ isEvent() }

// CommandIn: a command of the coordinator arrived; Err says why it could
// not be decoded or is invalid. ID names the answer.
type CommandIn struct {
	ID  uint64
	Cmd protocol.Command
	Err error
}

// EpochChecked: the outcome of a CheckEpoch.
type EpochChecked struct {
	Epoch uint64
	Err   error
}

// Bound: the subscriptions of a BindShards are flushed (the server knows
// them); Failed lists the shards that could not be bound, Err says why.
type Bound struct {
	ID     uint64
	Failed []int
	Err    error
}

// CaughtUp: the shard's replay reached its end marker and its buffer was
// purged: it can go live.
type CaughtUp struct {
	Shard int
	Life  uint64
}

// EntitiesStopped: the entities of the shard's life have all stopped.
type EntitiesStopped struct {
	Shard int
	Life  uint64
}

// ReleaseDone: a Release action ended.
type ReleaseDone struct {
	Token uint64
	Err   error
}

// Fenced: the region must stop serving every shard at once (its
// connection dropped, its registration was lost or not renewed in time).
// Incarnation is the one fenced: a fence of an earlier incarnation (one
// that came after the next registration) changes nothing.
type Fenced struct {
	Reason      string
	Incarnation string
}

// SourceFenced: the shard's buffer is fenced on the handoff the shard is
// paused for (kvstate.Buffer.Clear): the coordinator took the shard from
// this region without its consent (the handoff timed out while the region
// was stalled). The shard is dropped; Life is its life here.
type SourceFenced struct {
	Shard int
	Life  uint64
}

// Suspended: the region's connection to NATS dropped. Every held shard
// rides it through rather than being dropped: a live one is suspended
// (arrivals held), a replaying one stops delivering where it is (its
// place in the buffer and the keys it delivered are kept) and holds
// arrivals, a paused one keeps diverting. Incarnation is the one
// suspended ("": the current one).
type Suspended struct {
	Incarnation string
	Reason      string
}

// Confirmed: back on NATS, the region renewed its registration (so the
// coordinator had not removed it) and then read the shard table, Rows
// (every row, from the stream leader, after the renewal): the outcome of
// ReadTable. Each suspended shard is kept, paused or dropped as its row
// says (see Core.confirmed), if no drop came since the round began
// (Drops, the count of Suspended events) and the read worked (Err).
type Confirmed struct {
	Incarnation string
	Drops       uint64
	Rows        []protocol.ShardRecord
	Err         error
}

// Leaving: the process is stopping (Agent.Leave): the region marks itself
// leaving, for good, and writes its registration at once. Written, when
// not nil, is closed once that write ended; Done once the region holds
// no shard.
type Leaving struct{ Written, Done chan struct{} }

// Closing: the region closes. Done, when not nil, is closed once no
// registration write is in flight (Core.Lease is then the last one).
type Closing struct{ Done chan struct{} }

func (CommandIn) isEvent()       {}
func (EpochChecked) isEvent()    {}
func (Bound) isEvent()           {}
func (CaughtUp) isEvent()        {}
func (EntitiesStopped) isEvent() {}
func (ReleaseDone) isEvent()     {}
func (Fenced) isEvent()          {}
func (SourceFenced) isEvent()    {}
func (Suspended) isEvent()       {}
func (Confirmed) isEvent()       {}
func (Leaving) isEvent()         {}
func (Closing) isEvent()         {}

// Action is an output of Core: something the driver must do, in order.
type Action interface{ isAction() }

// Answer: send the reply to command ID. Refused: the command was refused
// (malformed, stale, for another incarnation...), counted as such. Probe:
// add the shards' load.
type Answer struct {
	ID      uint64
	Reply   protocol.Reply
	Refused bool
	Probe   bool
}

// CheckEpoch: read the coordinator lease and report whether Epoch is its
// epoch (EpochChecked).
type CheckEpoch struct{ Epoch uint64 }

// BindShards: subscribe to each shard and start replaying its buffer up
// to the end marker Handoffs[i] (holding what arrives), flush, and report
// Bound; each replay reports CaughtUp when it reached its marker.
type BindShards struct {
	ID       uint64
	Shards   []int
	Handoffs []uint64
	Lives    []uint64
}

// GoLive: deliver what the shard held, in order, and serve it live.
type GoLive struct {
	Shard int
	Life  uint64
}

// Pause: divert the shard's arrivals to its buffer and stop its entities;
// report EntitiesStopped.
type Pause struct {
	Shard   int
	Handoff uint64
	Life    uint64
}

// Suspend: hold the live shard's arrivals (a durable shard stops
// pulling) until Resume or Unbind; a replaying shard stops delivering
// what it replays, where it is, until Resume or Unbind (it holds its
// arrivals already).
type Suspend struct {
	Shard int
	Life  uint64
}

// Resume: deliver what the suspended shard held, in order, and serve it
// live again; a replaying shard goes on replaying from where it stopped.
type Resume struct {
	Shard int
	Life  uint64
}

// Unbind: stop serving the shard at once, in whatever mode: unsubscribe,
// end its replay, refuse what it held, end its entities' context and stop
// them; no end marker.
type Unbind struct {
	Shard int
	Life  uint64
	Why   string
}

// Release: the source's last step of a handoff (docs/PROTOCOL.md,
// "Handoff", step 5): when Held, keep diverting for the release grace,
// then drain the subscription (what it received is buffered) and forget
// the shard; then, held or not, append the end marker Handoff to the
// shard's buffer.
// Report ReleaseDone with Token.
type Release struct {
	Token   uint64
	Shard   int
	Handoff uint64
	Held    bool
}

// Log: say it; a Log with a Limit kind is said at most once per
// logEvery for that kind.
type Log struct {
	Level slog.Level
	Msg   string
	Args  []any
	Limit string
}

func (Answer) isAction()     {}
func (CheckEpoch) isAction() {}
func (BindShards) isAction() {}
func (GoLive) isAction()     {}
func (Suspend) isAction()    {}
func (Resume) isAction()     {}
func (Pause) isAction()      {}
func (Unbind) isAction()     {}
func (Release) isAction()    {}
func (Log) isAction()        {}
