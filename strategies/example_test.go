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

	// 30 shards on 3 regions: optimal is 10, and with the default limits
	// (none in effect) a round moves every shard above it, the oldest ones
	// of the most loaded region first.
	moved, err := s.Rebalance(regions, nil)
	fmt.Println(moved, err)

	// Nothing moves while a rebalance is in progress.
	moved, err = s.Rebalance(regions, moved)
	fmt.Println(moved, err)

	// Output:
	// c <nil>
	// [0 1 2 3 4 5 6 7 8 9] <nil>
	// [] <nil>
}

func ExampleNewLegacyLeastShard() {
	s := strategies.NewLegacyLeastShard(2, 3)
	regions := []strategies.Region{
		{ID: "a", Shards: []int{5, 0, 4, 1, 3, 2}},
		{ID: "b", Shards: []int{6, 7}},
		{ID: "c"},
	}

	// A new shard goes to the region with fewest shards.
	id, err := s.Allocate(8, "a", regions)
	fmt.Println(id, err)

	// a holds 6 shards, c none: 6-0 > 2, so min(6-2, 2, 3-0) = 2 shards
	// move, the lowest-numbered of a.
	moved, err := s.Rebalance(regions, nil)
	fmt.Println(moved, err)

	// With one in progress, a's 5 others against c: min(5-2, 2, 3-1) = 2.
	moved, err = s.Rebalance(regions, []int{0})
	fmt.Println(moved, err)

	// Nothing more once 3 shards are in progress.
	moved, err = s.Rebalance(regions, []int{0, 1, 7})
	fmt.Println(moved, err)

	// Output:
	// c <nil>
	// [0 1] <nil>
	// [1 2] <nil>
	// [] <nil>
}

func ExampleNewConsistentHashing() {
	s := strategies.NewConsistentHashing(strategies.DefaultVirtualNodes, 0)
	regions := []strategies.Region{{ID: "a"}, {ID: "b"}}

	// Place shards 0..11 on their ring owners.
	for shard := range 12 {
		id, _ := s.Allocate(shard, "", regions)
		for i := range regions {
			if regions[i].ID == id {
				regions[i].Shards = append(regions[i].Shards, shard)
			}
		}
	}
	fmt.Println(regions[0].Shards, regions[1].Shards)

	// c joins: only the shards that land on c's points move, all to c.
	regions = append(regions, strategies.Region{ID: "c"})
	moved, err := s.Rebalance(regions, nil)
	fmt.Println(moved, err)
	for _, shard := range moved {
		id, _ := s.Allocate(shard, "", regions)
		fmt.Print(id, " ")
	}
	fmt.Println()

	// Output:
	// [2 5 6 8 10] [0 1 3 4 7 9 11]
	// [1 7 9] <nil>
	// c c c
}

func ExampleNewExternal() {
	// Shard 7 is pinned to b; least-shard places the others.
	s := strategies.NewExternal(map[int]string{7: "b"}, nil)
	regions := []strategies.Region{
		{ID: "a", Shards: []int{1, 2, 3, 7}},
		{ID: "b", Shards: []int{4}},
		{ID: "c"},
	}

	for _, shard := range []int{7, 9} {
		id, err := s.Allocate(shard, "", regions)
		fmt.Println(shard, id, err)
	}

	// 7 goes home; least-shard sees a: 1 2 3, b: 4, c: none (7 hidden),
	// optimal ceil(4/3) = 2, and moves a's oldest shard.
	moved, err := s.Rebalance(regions, nil)
	fmt.Println(moved, err)

	// Output:
	// 7 b <nil>
	// 9 c <nil>
	// [7 1] <nil>
}

func ExampleNewLoadAware() {
	s := strategies.NewLoadAware(strategies.LoadAwareConfig{}) // hysteresis 0.2, 10 moves a round
	load := func(mps ...float64) (out []strategies.ShardLoad) {
		for _, m := range mps {
			out = append(out, strategies.ShardLoad{MessagesPerSecond: m})
		}
		return out
	}
	regions := []strategies.Region{
		{ID: "a", Shards: []int{0, 1, 2, 3}, Load: load(40, 30, 20, 10)}, // 100
		{ID: "b", Shards: []int{4}, Load: load(10)},                      // 10
		{ID: "c", Shards: []int{5}, Load: load(10)},                      // 10
	}

	// A new shard goes to the least loaded region.
	id, err := s.Allocate(6, "", regions)
	fmt.Println(id, err)

	// The mean is 40 and a is above 40*1.2 = 48. 0 (40) goes to b (50),
	// 1 (30) to c (40), then b, now the most loaded, gives 4 (10) to a:
	// every region ends at 40.
	moved, err := s.Rebalance(regions, nil)
	fmt.Println(moved, err)

	// Within the band nothing moves.
	regions = []strategies.Region{
		{ID: "a", Shards: []int{0, 1}, Load: load(25, 20)}, // 45
		{ID: "b", Shards: []int{2}, Load: load(40)},        // 40
		{ID: "c", Shards: []int{3, 4, 5}, Load: load(10, 15, 10)},
	}
	moved, err = s.Rebalance(regions, nil)
	fmt.Println(moved, err)

	// Output:
	// b <nil>
	// [0 1 4] <nil>
	// [] <nil>
}
