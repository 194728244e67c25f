package strategies

import "errors"

// Region is a shard region as a strategy sees it.
type Region struct {
	ID      string
	Shards  []int  // the shards it holds, oldest allocation first
	Version string // application version of the process
	Leaving bool   // shutting down or draining: never a target

	// Load is the measured load of Shards[i] at Load[i], for the
	// load-aware strategy; the others ignore it. A nil or shorter Load
	// leaves the load of the remaining shards unknown (see NewLoadAware);
	// entries past len(Shards) are ignored.
	Load []ShardLoad
}

// ShardLoad is the load one shard puts on its region, as the region last
// reported it.
type ShardLoad struct {
	MessagesPerSecond float64 // messages handled per second
	Entities          int     // live entities
}

// Strategy decides where shards go. Implementations are pure functions of
// their arguments and never modify them.
type Strategy interface {
	// Allocate returns the ID of the region that should own shard, which has no owner.
	Allocate(shard int, requester string, regions []Region) (string, error)
	// Rebalance returns the shards to move off their regions this round.
	Rebalance(regions []Region, inProgress []int) ([]int, error)
}

// ErrNoRegion is returned, wrapped with detail, by Allocate when no region
// can take the shard.
var ErrNoRegion = errors.New("strategies: no region can take the shard")
