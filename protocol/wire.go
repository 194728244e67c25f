package protocol

import (
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/vmihailenco/msgpack/v5"
)

// Encode marshals a wire type or KV record with msgpack.
func Encode(v any) ([]byte, error) {
	return msgpack.Marshal(v)
}

// Decode unmarshals msgpack data into v. Any failure, including trailing
// garbage, is reported as ErrMalformed; it never panics on input, and it
// allocates in proportion to len(data), whatever lengths data declares.
func Decode(data []byte, v any) error {
	if len(data) == 0 {
		return fmt.Errorf("%w: empty", ErrMalformed)
	}
	if err := wellFormed(data); err != nil {
		return fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if err := msgpack.Unmarshal(data, v); err != nil {
		return fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	return nil
}

// CommandKind says what a coordinator command asks of a region.
type CommandKind uint8

// Command kinds.
const (
	// CmdProbe asks a region whether it is there and which shards it holds.
	CmdProbe CommandKind = 1
	// CmdBind tells a region to own shards: subscribe to their subjects and
	// serve them.
	CmdBind CommandKind = 2
	// CmdDrop tells a region to stop serving shards at once: unsubscribe and
	// stop their entities, with no end marker (forced reallocation).
	CmdDrop CommandKind = 3
	// CmdHandOff tells the owner to pause shards (docs/PROTOCOL.md, "Handoff",
	// step 2): keep the subscription, divert every arrival to the shard's
	// buffer, stop the shard's entities. Reply.Complete says the entities have
	// all stopped.
	CmdHandOff CommandKind = 4
	// CmdRelease tells the source of a handoff (step 5) to keep diverting
	// for the grace period, then unsubscribe and append the end marker
	// Handoffs[i] to the shard's buffer.
	CmdRelease CommandKind = 5
	// CmdLeave tells a region to mark itself leaving (drain): it gets no new
	// shard and the coordinator hands all of its shards off.
	CmdLeave CommandKind = 6
	// CmdUndrain tells a drained region to take shards again (shardctl
	// undrain): it clears its leaving mark. A region that still holds a
	// shard refuses it: it is being drained, or its process is stopping
	// (a stopping process marks itself leaving too, and exits as soon as
	// it holds no shard).
	CmdUndrain CommandKind = 7
	// CmdSplit tells a region that the type splits to Count shards
	// (resharding, docs/PROTOCOL.md): once the stored configuration says
	// so, every shard it holds gives its children to the region, which
	// serves them. A region still replaying a shard answers it in
	// Reply.Replaying and splits nothing; the coordinator asks again.
	CmdSplit CommandKind = 8
)

func (k CommandKind) String() string {
	switch k {
	case CmdProbe:
		return "probe"
	case CmdBind:
		return "bind"
	case CmdDrop:
		return "drop"
	case CmdHandOff:
		return "handoff"
	case CmdRelease:
		return "release"
	case CmdLeave:
		return "leave"
	case CmdUndrain:
		return "undrain"
	case CmdSplit:
		return "split"
	}
	return fmt.Sprintf("command(%d)", uint8(k))
}

// Command is sent by the coordinator to a region's command subject as a
// request; the region answers with a Reply. A region refuses a command
// whose epoch is older than the newest it has seen, or whose incarnation is
// not its own.
type Command struct {
	Kind        CommandKind `msgpack:"k"`
	Epoch       uint64      `msgpack:"e"`
	Coordinator string      `msgpack:"c"` // region id of the coordinator's process
	Incarnation string      `msgpack:"i"` // the region incarnation the command is for
	Shards      []int       `msgpack:"s,omitempty"`
	// Handoffs holds, for bind, handoff and release, the handoff id of each
	// of Shards (same length): the id of the end marker that closes the
	// shard's buffer for this move.
	Handoffs []uint64 `msgpack:"h,omitempty"`
	// Count is, for split, the shard count the type splits to.
	Count int `msgpack:"n,omitempty"`
}

// Validate checks a decoded command against the shard count n.
func (c *Command) Validate(n int) error {
	switch c.Kind {
	case CmdProbe, CmdDrop, CmdLeave, CmdUndrain:
		if len(c.Handoffs) != 0 {
			return fmt.Errorf("%w: %s with handoff ids", ErrMalformed, c.Kind)
		}
	case CmdSplit:
		if len(c.Handoffs) != 0 || len(c.Shards) != 0 {
			return fmt.Errorf("%w: split with shards or handoff ids", ErrMalformed)
		}
		if c.Count < 1 || c.Count > MaxShards {
			return fmt.Errorf("%w: split to %d shards, out of range 1..%d", ErrMalformed, c.Count, MaxShards)
		}
	case CmdBind, CmdHandOff, CmdRelease:
		if len(c.Handoffs) != len(c.Shards) {
			return fmt.Errorf("%w: %s with %d shards and %d handoff ids", ErrMalformed, c.Kind, len(c.Shards), len(c.Handoffs))
		}
		for _, h := range c.Handoffs {
			if h == 0 {
				return fmt.Errorf("%w: %s with handoff id 0", ErrMalformed, c.Kind)
			}
		}
	default:
		return fmt.Errorf("%w: unknown command kind %d", ErrMalformed, c.Kind)
	}
	if c.Epoch == 0 {
		return fmt.Errorf("%w: %s without epoch", ErrMalformed, c.Kind)
	}
	for _, s := range c.Shards {
		if s < 0 || s >= n {
			return fmt.Errorf("%w: %s names shard %d, out of range 0..%d", ErrMalformed, c.Kind, s, n-1)
		}
	}
	return nil
}

// Reply answers a Command. Error is empty on success.
type Reply struct {
	Epoch       uint64 `msgpack:"e"`           // the newest epoch the region has seen
	Incarnation string `msgpack:"i"`           // the region's incarnation
	Held        []int  `msgpack:"h,omitempty"` // shards subscribed (serving, replaying or diverting)
	Error       string `msgpack:"x,omitempty"`
	// Complete answers handoff: every shard of the command is paused and
	// its entities have stopped.
	Complete bool `msgpack:"c,omitempty"`
	// Replaying answers handoff: the command's shards that are still
	// replaying their buffer here (bound moments ago). The region pauses
	// them once live, when asked again; the coordinator restarts their
	// handoff timeout meanwhile, since the region is busy, not stuck.
	Replaying []int `msgpack:"r,omitempty"`
	// Live answers bind: the command's shards this region served live
	// already (bound by an earlier command). A coordinator that parked
	// such a shard meanwhile discards what it diverted, since the owner
	// received it too. Regions older than this field send none.
	Live []int `msgpack:"v,omitempty"`
	// Load answers probe: the measured load of the held shards whose
	// message rate has been measured (see ShardLoad). Regions older than
	// load reports send none; the coordinator then knows no load.
	Load []ShardLoad `msgpack:"l,omitempty"`
}

// ShardLoad is the load of one shard as the region that holds it measures
// it: Rate is the messages handed to the shard's entities per second,
// averaged exponentially over about five seconds, and Entities the
// entities it holds now.
type ShardLoad struct {
	Shard    int     `msgpack:"s"`
	Rate     float64 `msgpack:"r,omitempty"`
	Entities int     `msgpack:"n,omitempty"`
}

// Pin is the value of KV key pins.<shard>: an operator pinned the shard to
// a region (shardctl pin). The coordinator writes it, fenced on its lease.
type Pin struct {
	Shard  int    `msgpack:"s"`
	Region string `msgpack:"r"`
}

// Daemon is the value of KV key daemon of a sharded daemon's type
// (natshard.Daemon): how many workers it keeps running. The first process
// that hosts the daemon creates it; natshard.ScaleDaemon and shardctl
// daemon scale change it.
type Daemon struct {
	Workers int `msgpack:"w"`
}

// MaxWorkers bounds a daemon's workers.
const MaxWorkers = 1 << 16

// WorkerClaim is the value of KV key workers.<index> of a sharded daemon's
// type: the region (and its Agent's instance, unique per process) that
// runs the worker, written before its run starts and removed once the run
// returned. The next run of the index waits until the claim is removed,
// or its region has been gone from the registry for a lease TTL.
type WorkerClaim struct {
	Region   string `msgpack:"r"`
	Instance string `msgpack:"in"`
}

// TypeConfig is the per-type configuration stored in KV; every process of
// the type must agree with it.
type TypeConfig struct {
	Shards int `msgpack:"n"`
	// Strategy is the canonical spec of the allocation strategy
	// (strategies.Parse); empty in buckets written before it existed,
	// which means the default.
	Strategy string `msgpack:"st,omitempty"`
	// Kind names what the type's entities are (a built-in kind of
	// shardd, or the name a library user gives); empty in buckets written
	// before it existed, which any kind may then join.
	Kind string `msgpack:"k,omitempty"`
	// Delivery is how messages reach the type's entities: DeliveryCore
	// (core NATS, the default; empty in buckets written before it
	// existed) or DeliveryDurable (through the type's stream).
	Delivery string `msgpack:"d,omitempty"`
	// Remember: the ids of the type's active entities are recorded per
	// shard, and a shard's new owner starts them again (remembered
	// entities); false in buckets written before it existed.
	Remember bool `msgpack:"r,omitempty"`
	// History holds the type's earlier shard counts, oldest first: it was
	// split (resharding, docs/PROTOCOL.md). Empty for a type never split,
	// and in buckets written before resharding existed.
	History []int `msgpack:"h,omitempty"`
	// To is, while a split runs, the shard count it goes to (the rows of
	// the new shards exist, regions may serve them); Shards is then still
	// the count publishers use. 0 when no split runs.
	To int `msgpack:"to,omitempty"`
	// Streams is, for a durable type, how many message streams its
	// messages are split over (shard s in stream s mod Streams; a divisor
	// of the first count, so of every later one), chosen when the type
	// was made (kvstate.MessageStreamsFor). 0 in buckets written before it
	// existed, and for core delivery: one stream.
	Streams int `msgpack:"ms,omitempty"`
}

// Layout is the configuration's shard counts: History, Shards, then To
// when a split runs. The error says what is wrong with a stored
// configuration whose counts are not a layout.
func (c TypeConfig) Layout() (Layout, error) {
	counts := append(append([]int(nil), c.History...), c.Shards)
	if c.To != 0 {
		counts = append(counts, c.To)
	}
	return NewLayout(counts...)
}

// Delivery modes of a type (TypeConfig.Delivery).
const (
	DeliveryCore    = "core"
	DeliveryDurable = "durable"
)

// DeliveryOf is the delivery mode a configuration stores (core when it
// names none).
func (c TypeConfig) DeliveryOf() string {
	if c.Delivery == "" {
		return DeliveryCore
	}
	return c.Delivery
}

// CoordinatorInfo is the value of the coordinator lease.
type CoordinatorInfo struct {
	Region      string `msgpack:"r"` // region id of the holder's process
	Incarnation string `msgpack:"i"` // unique per acquisition
	Since       int64  `msgpack:"t"` // unix milliseconds of acquisition
	// Epoch is the revision at which the lease was acquired; written by the
	// renewals (the acquiring write cannot know it), so readers of KV can
	// tell the epoch after the lease's revision moved on. 0 before the
	// first renewal: the lease's revision is the epoch then.
	Epoch uint64 `msgpack:"e,omitempty"`
	// Probe, when set, is the holder's probe id: its process answers
	// requests on Subjects.Coordinator(Probe) for as long as its NATS
	// connection lives, so that a candidate that gets "no responders"
	// there may depose it (PROTOCOL.md, Coordinator failover). Empty
	// (holders before this field, or one whose answer it could not check)
	// means candidates wait for the lease to expire.
	Probe string `msgpack:"p,omitempty"`
	// Conn is the holder's NATS connection when it took the lease.
	Conn ConnID `msgpack:"n,omitempty"`
}

// RegionInfo is the value of a region's registration lease.
type RegionInfo struct {
	ID          string `msgpack:"id"`
	Incarnation string `msgpack:"i"` // unique per registration; a new one means the old shards are gone
	Version     string `msgpack:"v,omitempty"`
	Leaving     bool   `msgpack:"l,omitempty"`
	Started     int64  `msgpack:"t"` // unix milliseconds of registration
	// Instance is unique per process (per region.Agent), the same for all
	// its incarnations: a registration of the id with another instance
	// was written by another process.
	Instance string `msgpack:"in,omitempty"`
	// Conn is the region's NATS connection when it registered: the
	// coordinator probes the region at once when the server reports that
	// connection closed.
	Conn ConnID `msgpack:"n,omitempty"`
}

// ConnID names a client connection the way the NATS server's advisories
// do: the id of the server it is connected to and the client id that
// server gave it. The zero value names none.
type ConnID struct {
	Server string `msgpack:"s"`
	Client uint64 `msgpack:"c"`
}

// IsZero says whether c names no connection.
func (c ConnID) IsZero() bool { return c.Server == "" || c.Client == 0 }

// ConnIDOf returns the connection nc has now, or the zero ConnID when it
// is not connected (or reconnected meanwhile).
func ConnIDOf(nc *nats.Conn) ConnID {
	server := nc.ConnectedServerId()
	cid, err := nc.GetClientID()
	if err != nil || server == "" || nc.ConnectedServerId() != server {
		return ConnID{}
	}
	return ConnID{Server: server, Client: cid}
}

// ShardState is the state of a shard in the shard table.
type ShardState string

// Shard states.
const (
	// StateUnowned: no region owns the shard.
	StateUnowned ShardState = "unowned"
	// StateActive: the region confirmed it serves the shard.
	StateActive ShardState = "active"
	// StateParked: no region owns the shard; the coordinator diverts its
	// messages to the buffer until an owner binds.
	StateParked ShardState = "parked"
	// StateHandoff: Source was told to pause the shard; waiting until its
	// entities have stopped.
	StateHandoff ShardState = "handoff"
	// StateBinding: Region was told to bind and replay the buffer up to
	// marker Handoff; Source still diverts until it is released.
	StateBinding ShardState = "binding"
)

// ShardRecord is one row of the shard table.
type ShardRecord struct {
	Shard       int        `msgpack:"s"`
	Region      string     `msgpack:"r,omitempty"`
	Incarnation string     `msgpack:"i,omitempty"`
	State       ShardState `msgpack:"st"`
	Order       uint64     `msgpack:"o,omitempty"` // allocation order: larger is newer
	Epoch       uint64     `msgpack:"e"`           // epoch of the coordinator that wrote it
	// During a move: the handoff id (end-marker id) and the source that
	// diverts to the buffer: a region id, or "" for the coordinator itself
	// (parking) together with SourceIncarnation "".
	Handoff           uint64 `msgpack:"h,omitempty"`
	Source            string `msgpack:"src,omitempty"`
	SourceIncarnation string `msgpack:"si,omitempty"`
}
