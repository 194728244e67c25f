package strategies_test

import (
	"fmt"

	"github.com/natshard/natshard/strategies"
)

func Example() {
	s := strategies.NewLeastShard(strategies.DefaultAbsoluteLimit, strategies.DefaultRelativeLimit)
	a := strategies.Region{ID: "a", Version: "1.4.0"}
	for shard := range 20 {
		a.Shards = append(a.Shards, shard)
	}
	regions := []strategies.Region{
		a,
		{ID: "b", Version: "1.4.0", Shards: []int{20, 21, 22, 23, 24, 25, 26, 27, 28, 29}},
		{ID: "c", Version: "1.4.0"},
		{ID: "d", Version: "1.3.9", Leaving: true},
	}

	// A new shard goes to the region with fewest shards that is not leaving.
	id, err := s.Allocate(30, "b", regions)
	fmt.Println(id, err)

	// 30 shards on 3 regions: optimal is 10, and a round moves at most
	// 10% of 30 = 3 shards, the oldest ones of the most loaded region.
	moved, err := s.Rebalance(regions, nil)
	fmt.Println(moved, err)

	// Nothing moves while a rebalance is in progress.
	moved, err = s.Rebalance(regions, moved)
	fmt.Println(moved, err)

	// Output:
	// c <nil>
	// [0 1 2] <nil>
	// [] <nil>
}
