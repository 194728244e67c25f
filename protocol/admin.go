package protocol

// The admin API answers JSON on <control>.<type>.admin.<verb>. Operators can
// call it with `nats req '$SHARD.kv.admin.status' ''`; shardctl uses it.

// Admin verbs.
const (
	AdminStatus = "status"
	AdminMove   = "move"  // body MoveRequest
	AdminDrain  = "drain" // body DrainRequest
)

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

// AdminError is the answer to an admin request that failed.
type AdminError struct {
	Error string `json:"error"`
}

// Status is the coordinator's answer to AdminStatus.
type Status struct {
	Type        string          `json:"type"`
	Shards      int             `json:"shards"`
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
}
