package strategies

import "fmt"

// noRegion is Allocate's error when no region can take shard.
func noRegion(shard int, regions []Region) error {
	return fmt.Errorf("%w: shard %d: none of %d regions accepts shards", ErrNoRegion, shard, len(regions))
}

// setOf returns the shards as a set.
func setOf(shards []int) map[int]bool {
	set := make(map[int]bool, len(shards))
	for _, sh := range shards {
		set[sh] = true
	}
	return set
}
