package protocol

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// The admin API answers JSON on <control>.<type>.admin.<verb>; only the
// coordinator leader listens. Regions answer queries on
// <control>.<type>.query.<region id>, and the coordinator publishes events
// on <control>.<type>.events. Operators can use all three with the nats CLI
// (`nats req '$SHARD.kv.admin.status' ''`); shardctl does. docs/API.md
// describes every request and answer.

// Admin verbs.
const (
	AdminStatus    = "status"
	AdminMove      = "move"      // body MoveRequest
	AdminDrain     = "drain"     // body DrainRequest
	AdminUndrain   = "undrain"   // body UndrainRequest
	AdminPin       = "pin"       // body PinRequest
	AdminUnpin     = "unpin"     // body UnpinRequest
	AdminRebalance = "rebalance" // body RebalanceRequest, answer RebalanceAnswer
	AdminReshard   = "reshard"   // body ReshardRequest
)

// ReshardRequest asks the coordinator to split every shard of the type
// so that it has Shards shards: a larger multiple of today's count
// (docs/PROTOCOL.md, Resharding). The answer (AdminOK) comes once the
// split is recorded; it is done when the stored configuration's count is
// Shards.
type ReshardRequest struct {
	Shards int `json:"shards"`
}

// MoveRequest asks the coordinator to move an active shard to a region.
type MoveRequest struct {
	Shard  int    `json:"shard"`
	Region string `json:"region"`
}

// DrainRequest asks the coordinator to move every shard off a region and
// give it no more (the region marks itself leaving).
type DrainRequest struct {
	Region string `json:"region"`
}

// UndrainRequest asks the coordinator to let a drained region take shards
// again (the region clears its leaving mark). It is refused while the
// region holds a shard: a leaving region with shards is being drained or
// its process is stopping, which the coordinator cannot tell apart.
type UndrainRequest struct {
	Region string `json:"region"`
}

// PinRequest pins a shard to a region: the shard is allocated there, and
// rebalance rounds move it there, whenever the region is registered and
// not leaving. The region need not be registered yet.
type PinRequest struct {
	Shard  int    `json:"shard"`
	Region string `json:"region"`
}

// UnpinRequest removes a shard's pin; the shard stays where it is until
// the strategy moves it.
type UnpinRequest struct {
	Shard int `json:"shard"`
}

// RebalanceRequest runs a strategy round now. With DryRun the coordinator
// only answers the plan.
type RebalanceRequest struct {
	DryRun bool `json:"dry_run,omitempty"`
}

// RebalanceAnswer is the plan of a round: the moves started (or, with
// DryRun, that would start), and how many shards were in progress (moving
// or parked), which most strategies wait for.
type RebalanceAnswer struct {
	DryRun     bool          `json:"dry_run"`
	Moves      []PlannedMove `json:"moves"`
	InProgress int           `json:"in_progress"`
}

// PlannedMove is one move of a rebalance round. To is where the strategy
// places the shard now; the coordinator asks it again once the shard has
// paused, so the move may end elsewhere if things changed meanwhile. ""
// when no region can take it.
type PlannedMove struct {
	Shard int    `json:"shard"`
	From  string `json:"from"`
	To    string `json:"to"`
}

// AdminOK is the answer to move, drain, undrain, pin and unpin when they
// succeed; Note says what follows, when it is not obvious.
type AdminOK struct {
	OK   bool   `json:"ok"`
	Note string `json:"note,omitempty"`
}

// AdminError is the answer to an admin request or a query that failed.
type AdminError struct {
	Error string `json:"error"`
	// Retry: the request may be taken later as it is (reshard, while
	// shards are moving).
	Retry bool `json:"retry,omitempty"`
}

// Status is the coordinator's answer to AdminStatus.
type Status struct {
	Type   string `json:"type"`
	Shards int    `json:"shards"`
	// History is the type's earlier shard counts, oldest first (it was
	// split); SplittingTo the count a split under way goes to.
	History     []int           `json:"history,omitempty"`
	SplittingTo int             `json:"splitting_to,omitempty"`
	Coordinator CoordinatorView `json:"coordinator"`
	Regions     []RegionView    `json:"regions"`
	Table       []ShardView     `json:"table"`
}

// CoordinatorView names the coordinator and its epoch.
type CoordinatorView struct {
	Region string `json:"region"`
	Epoch  uint64 `json:"epoch"`
}

// RegionView is one region as operators see it.
type RegionView struct {
	ID          string `json:"id"`
	Incarnation string `json:"incarnation"`
	Version     string `json:"version,omitempty"`
	Leaving     bool   `json:"leaving,omitempty"`
	Shards      int    `json:"shards"`
}

// ShardView is one shard as operators see it.
type ShardView struct {
	Shard  int    `json:"shard"`
	Region string `json:"region"`
	State  string `json:"state"`
	// Source is the region a moving shard comes from ("" for the
	// coordinator, or when not moving).
	Source string `json:"source,omitempty"`
	// Pin is the region the shard is pinned to, if any.
	Pin string `json:"pin,omitempty"`
}

// Limits of QueryRequest.Limit.
const (
	DefaultEntityLimit = 1000
	MaxEntityLimit     = 100_000
)

// QueryRequest asks a region about the shards it holds (all of them when
// Shards is empty). With Entities, the answer lists entity ids, at most
// Limit of them over all shards (DefaultEntityLimit when 0), and fewer if
// they would not fit in a NATS message.
type QueryRequest struct {
	Shards   []int `json:"shards,omitempty"`
	Entities bool  `json:"entities,omitempty"`
	Limit    int   `json:"limit,omitempty"`
}

// QueryAnswer is a region's answer to a QueryRequest: the shards it holds
// among those asked for, ascending.
type QueryAnswer struct {
	Region      string `json:"region"`
	Incarnation string `json:"incarnation"`
	// Instance is unique per process (per region.Agent) for its whole
	// life, across incarnations: two answers with different instances
	// for one region id come from two processes.
	Instance string        `json:"instance,omitempty"`
	Shards   []ShardReport `json:"shards"`
}

// ShardReport is one held shard as its region sees it. Mode is replaying
// (bound, replaying the buffer), live or paused (handing off). Entities
// counts the entities held; EntityIDs lists them (sorted) when asked for,
// Truncated saying that some were left out.
type ShardReport struct {
	Shard             int      `json:"shard"`
	Mode              string   `json:"mode"`
	Entities          int      `json:"entities"`
	MessagesPerSecond float64  `json:"messages_per_second"`
	EntityIDs         []string `json:"entity_ids,omitempty"`
	Truncated         bool     `json:"truncated,omitempty"`
}

// Kinds of Event.
const (
	EventCoordinator = "coordinator" // a coordinator took the lease: Region, Epoch
	EventShard       = "shard"       // a shard table row changed: Shard, State, Region, Source
	EventRegionUp    = "region-up"   // a region registered: Region
	EventLeaving     = "region-leaving"
	EventUndrained   = "region-undrained" // a leaving region takes shards again: Region
	EventRegionGone  = "region-gone"
	EventPin         = "pin"   // Shard pinned to Region
	EventUnpin       = "unpin" // Shard's pin removed
	// EventSplit: a split was recorded (State "committed", Shards the
	// count it goes to) or announced (State "announced", Shards the
	// type's count from now on).
	EventSplit = "split"
)

// Event is what the coordinator leader publishes on the events subject,
// after it happened (for shard rows: after the write was accepted).
// Events are core NATS messages: a watcher sees those published while it
// is subscribed, at most once.
type Event struct {
	Time   string `json:"time"` // RFC 3339, nanoseconds, UTC
	Epoch  uint64 `json:"epoch"`
	Kind   string `json:"kind"`
	Shard  *int   `json:"shard,omitempty"`
	State  string `json:"state,omitempty"`
	Region string `json:"region,omitempty"`
	Source string `json:"source,omitempty"`
	Shards int    `json:"shards,omitempty"`
}

// DecodeJSON decodes an admin request or query strictly: an empty body,
// unknown fields and trailing data are errors.
func DecodeJSON(data []byte, v any) error {
	if len(bytes.TrimSpace(data)) == 0 {
		return errors.New("bad request: empty body (send a JSON object)")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("bad request: %w", err)
	}
	if dec.More() {
		return errors.New("bad request: trailing data")
	}
	return nil
}
