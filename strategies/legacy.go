package strategies

import (
	"cmp"
	"slices"
)

// Defaults of NewLegacyLeastShard, Akka 2.5's: rebalance when the most and
// fewest shards differ by more than 1, at most 3 shards in flight.
const (
	DefaultLegacyThreshold       = 1
	DefaultLegacyMaxSimultaneous = 3
)

// NewLegacyLeastShard returns the least-shard strategy as it was before
// Akka 2.6.10, LeastShardAllocationStrategy(rebalanceThreshold,
// maxSimultaneousRebalance), since deprecated in favour of NewLeastShard.
//
// Allocate picks the region with fewest shards that is not leaving, ties
// broken as in NewLeastShard (newest version, then ID ascending). Unlike
// NewLeastShard, the shard count comes before the version.
//
// Rebalance returns nothing when inProgress holds maxSimultaneous or more
// distinct shards. Otherwise, among the regions that are not leaving, it
// takes the least loaded (fewest shards, in-progress ones included, ties
// as Allocate) and the most loaded (most shards not in progress, ties by
// ID ascending). With diff the difference of the two counts, when
// diff > threshold it returns the
//
//	min(diff-threshold, threshold, maxSimultaneous-len(inProgress))
//
// lowest-numbered shards of the most loaded region that are not in
// progress, in ascending order. A threshold below 1 never moves anything.
// It does not hold back during rolling updates (mixed versions), and never
// returns shards of leaving regions. The strategy is stateless and safe
// for concurrent use.
func NewLegacyLeastShard(threshold, maxSimultaneous int) Strategy {
	return legacyLeastShard{threshold: threshold, maxSimultaneous: maxSimultaneous}
}

type legacyLeastShard struct {
	threshold, maxSimultaneous int
}

func (s legacyLeastShard) Allocate(shard int, requester string, regions []Region) (string, error) {
	best := fewestShards(regions)
	if best < 0 {
		return "", noRegion(shard, regions)
	}
	return regions[best].ID, nil
}

// fewestShards returns the index of the region that is not leaving with
// fewest shards, ties by suitability, or -1 when every region is leaving.
func fewestShards(regions []Region) int {
	best := -1
	for i := range regions {
		if regions[i].Leaving {
			continue
		}
		if best < 0 || cmp.Or(cmp.Compare(len(regions[i].Shards), len(regions[best].Shards)), suitability(&regions[i], &regions[best])) < 0 {
			best = i
		}
	}
	return best
}

func (s legacyLeastShard) Rebalance(regions []Region, inProgress []int) ([]int, error) {
	busy := setOf(inProgress)
	if len(busy) >= s.maxSimultaneous {
		return nil, nil
	}
	least := fewestShards(regions)
	if least < 0 {
		return nil, nil
	}
	var most []int
	mostAt := -1
	for i := range regions {
		r := &regions[i]
		if r.Leaving {
			continue
		}
		free := slices.DeleteFunc(slices.Clone(r.Shards), func(sh int) bool { return busy[sh] })
		if mostAt < 0 || len(free) > len(most) || len(free) == len(most) && r.ID < regions[mostAt].ID {
			most, mostAt = free, i
		}
	}
	diff := len(most) - len(regions[least].Shards)
	if diff <= s.threshold {
		return nil, nil
	}
	n := min(diff-s.threshold, s.threshold, s.maxSimultaneous-len(busy))
	if n <= 0 {
		return nil, nil
	}
	slices.Sort(most)
	return slices.Clip(most[:n]), nil
}
