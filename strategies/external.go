package strategies

import (
	"fmt"
	"maps"
	"slices"
)

// NewExternal returns a strategy that keeps the shards operators pinned on
// their pinned regions and leaves the other shards to fallback (nil means
// NewLeastShard with the default limits).
//
// pins maps a shard to the ID of the region it should live on. NewExternal
// copies it and never modifies either map, so the caller may reuse its map;
// the coordinator keeps pins in its KV store and builds a new External
// whenever they change. A pin is in force while its region is present and
// not leaving; otherwise the shard is not treated as pinned.
//
// Allocate returns the pinned region of a shard whose pin is in force, and
// otherwise asks fallback.
//
// Rebalance returns, first, the shards whose pin is in force that are held
// by another region that is not leaving, in ascending order, leaving out
// those in progress; then what fallback's Rebalance returns, in its order,
// without duplicates.
//
// The fallback never sees the shards whose pin is in force: both its
// Allocate and Rebalance get the regions without them (and without their
// Load entries), so it balances the other shards among themselves and
// never moves a pinned shard. It gets inProgress unchanged. The strategy
// is as deterministic as fallback, and safe for concurrent use if fallback
// is.
func NewExternal(pins map[int]string, fallback Strategy) Strategy {
	if fallback == nil {
		fallback = NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit)
	}
	return external{pins: maps.Clone(pins), fallback: fallback}
}

type external struct {
	pins     map[int]string // never modified
	fallback Strategy
}

// inForce returns the pins whose region is present and not leaving.
func (s external) inForce(regions []Region) map[int]string {
	open := map[string]bool{}
	for i := range regions {
		if !regions[i].Leaving {
			open[regions[i].ID] = true
		}
	}
	pins := map[int]string{}
	for sh, id := range s.pins {
		if open[id] {
			pins[sh] = id
		}
	}
	return pins
}

func (s external) Allocate(shard int, requester string, regions []Region) (string, error) {
	pins := s.inForce(regions)
	if id, ok := pins[shard]; ok {
		return id, nil
	}
	return s.fallback.Allocate(shard, requester, withoutShards(regions, pins))
}

func (s external) Rebalance(regions []Region, inProgress []int) ([]int, error) {
	pins := s.inForce(regions)
	busy := setOf(inProgress)
	var out []int
	for i := range regions {
		r := &regions[i]
		if r.Leaving {
			continue
		}
		for _, sh := range r.Shards {
			if id, ok := pins[sh]; ok && id != r.ID && !busy[sh] {
				out = append(out, sh)
			}
		}
	}
	slices.Sort(out)
	out = slices.Compact(out)
	more, err := s.fallback.Rebalance(withoutShards(regions, pins), inProgress)
	if err != nil {
		return nil, fmt.Errorf("strategies: external fallback: %w", err)
	}
	seen := setOf(out)
	for _, sh := range more {
		if _, pinned := pins[sh]; !pinned && !seen[sh] {
			seen[sh] = true
			out = append(out, sh)
		}
	}
	return out, nil
}

// withoutShards returns regions without the shards in drop, and without
// their Load entries. Regions that lose nothing share their slices with
// regions; the others get new ones.
func withoutShards[V any](regions []Region, drop map[int]V) []Region {
	if len(drop) == 0 {
		return regions
	}
	out := slices.Clone(regions)
	for i := range out {
		r := &out[i]
		if !slices.ContainsFunc(r.Shards, func(sh int) bool { _, ok := drop[sh]; return ok }) {
			continue
		}
		var shards []int
		var load []ShardLoad
		for j, sh := range r.Shards {
			if _, ok := drop[sh]; ok {
				continue
			}
			shards = append(shards, sh)
			if j < len(r.Load) {
				load = append(load, r.Load[j])
			}
		}
		r.Shards, r.Load = shards, load
	}
	return out
}
