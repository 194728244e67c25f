package protocol

// The admin API answers JSON on <control>.<type>.admin.<verb>. Operators can
// call it with `nats req '$SHARD.kv.admin.status' ''`; shardctl uses it.

// Admin verbs.
const (
	AdminStatus = "status"
)

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
}
