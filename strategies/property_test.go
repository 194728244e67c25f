package strategies

import (
	"fmt"
	"math/rand"
	"slices"
	"testing"
)

func newRand(seed int64) *rand.Rand { return rand.New(rand.NewSource(seed)) }

// randomAllocation places shards 0..nShards-1 unevenly on nRegions regions
// of one version, each region's shards in random order.
func randomAllocation(rng *rand.Rand, nRegions, nShards int) []Region {
	regions := make([]Region, nRegions)
	for i := range regions {
		regions[i] = Region{ID: fmt.Sprintf("r%03d", i), Version: "1.0.0"}
	}
	var pick func() int
	switch rng.Intn(4) {
	case 0: // all on one region
		r := rng.Intn(nRegions)
		pick = func() int { return r }
	case 1: // uniformly at random
		pick = func() int { return rng.Intn(nRegions) }
	case 2: // skewed towards the first regions
		pick = func() int { return rng.Intn(1 + rng.Intn(nRegions)) }
	default: // on a few regions, the others empty
		k := 1 + rng.Intn(nRegions)
		pick = func() int { return rng.Intn(k) }
	}
	for _, sh := range rng.Perm(nShards) {
		r := pick()
		regions[r].Shards = append(regions[r].Shards, sh)
	}
	return regions
}

func sizes(regions []Region) []int {
	out := make([]int, len(regions))
	for i, r := range regions {
		out[i] = len(r.Shards)
	}
	return out
}

// spread is the most shards on a region minus the fewest.
func spread(regions []Region) int {
	s := sizes(regions)
	if len(s) == 0 {
		return 0
	}
	return slices.Max(s) - slices.Min(s)
}

// checkPlacement fails unless shards 0..total-1 are each on exactly one region.
func checkPlacement(t *testing.T, regions []Region, total int) {
	t.Helper()
	seen := make([]bool, total)
	n := 0
	for _, r := range regions {
		for _, sh := range r.Shards {
			if sh < 0 || sh >= total || seen[sh] {
				t.Fatalf("shard %d misplaced or placed twice (region %s)", sh, r.ID)
			}
			seen[sh] = true
			n++
		}
	}
	if n != total {
		t.Fatalf("%d shards placed, want %d", n, total)
	}
}

// simulate runs rounds until the regions are balanced (most and fewest
// shards differ by at most one) and returns how many it took, failing
// after maxRounds. A round removes the shards Rebalance returns from
// their regions, then gives them out one by one through Allocate,
// appending each to its new region.
func simulate(t *testing.T, s Strategy, regions []Region, maxRounds int) int {
	t.Helper()
	regions = cloneRegions(regions)
	total := 0
	index := map[string]int{}
	for i, r := range regions {
		total += len(r.Shards)
		index[r.ID] = i
	}
	for round := 0; ; round++ {
		checkPlacement(t, regions, total)
		if spread(regions) <= 1 {
			if moved, err := s.Rebalance(regions, nil); len(moved) != 0 || err != nil {
				t.Fatalf("balanced %v, yet Rebalance = %v, %v", sizes(regions), moved, err)
			}
			return round
		}
		if round == maxRounds {
			t.Fatalf("not balanced after %d rounds: %v", round, sizes(regions))
		}
		moved, err := s.Rebalance(regions, nil)
		if err != nil || len(moved) == 0 {
			t.Fatalf("round %d: unbalanced %v, yet Rebalance = %v, %v", round+1, sizes(regions), moved, err)
		}
		leave := map[int]bool{}
		for _, sh := range moved {
			if leave[sh] {
				t.Fatalf("shard %d returned twice", sh)
			}
			leave[sh] = true
		}
		for i := range regions {
			regions[i].Shards = slices.DeleteFunc(regions[i].Shards, func(sh int) bool {
				if leave[sh] {
					delete(leave, sh)
					return true
				}
				return false
			})
		}
		if len(leave) != 0 {
			t.Fatalf("Rebalance returned shards no region holds: %v", leave)
		}
		for _, sh := range moved {
			id, err := s.Allocate(sh, "", regions)
			if err != nil {
				t.Fatalf("Allocate(%d): %v", sh, err)
			}
			i := index[id]
			regions[i].Shards = append(regions[i].Shards, sh)
		}
	}
}

func TestConvergesSmall(t *testing.T) {
	s := NewLeastShard(1<<30, 1.0)
	for seed := range int64(300) {
		rng := newRand(seed)
		regions := randomAllocation(rng, 1+rng.Intn(20), rng.Intn(201))
		simulate(t, s, regions, 2)
	}
}

func TestConvergesLarge(t *testing.T) {
	s := NewLeastShard(1<<30, 1.0)
	for seed := range int64(40) {
		rng := newRand(seed)
		regions := randomAllocation(rng, 1+rng.Intn(100), rng.Intn(1001))
		simulate(t, s, regions, 5)
	}
	// The extremes: everything on one region, or on all but one.
	regions := randomAllocation(newRand(0), 100, 0)
	regions[0].Shards = seq(0, 1000)
	simulate(t, s, regions, 2)
	for i := range regions {
		regions[i].Shards = seq(i*10, 10)
	}
	regions[0].Shards = nil
	regions[1].Shards = seq(0, 20)
	simulate(t, s, regions, 2)
}

// With limits a round moves at most `limit` shards, so phase 1 takes
// ceil(excess/limit) rounds and phase 2, which has fewer than one shard per
// region to move, at most ceil(regions/limit) more. With the default
// limits (none in effect) that is two rounds at most, whatever the
// allocation.
func TestConvergesWithLimits(t *testing.T) {
	for _, lim := range []struct {
		absolute int
		relative float64
		bound    int // the most rounds, whatever the allocation; 0: only the formula's bound
	}{{DefaultAbsoluteLimit, DefaultRelativeLimit, 2}, {20, 0.1, 0}} {
		s := NewLeastShard(lim.absolute, lim.relative)
		for seed := range int64(100) {
			rng := newRand(seed)
			regions := randomAllocation(rng, 1+rng.Intn(20), rng.Intn(401))
			total := 0
			for _, r := range regions {
				total += len(r.Shards)
			}
			optimal := (total + len(regions) - 1) / len(regions)
			excess := 0
			for _, r := range regions {
				excess += max(0, len(r.Shards)-optimal)
			}
			limit := leastShard{lim.absolute, lim.relative}.limit(total)
			bound := (excess+limit-1)/limit + (len(regions)+limit-1)/limit
			if lim.bound > 0 {
				bound = min(bound, lim.bound)
			}
			simulate(t, s, regions, bound)
		}
	}
}

// A fourth, empty region joins three balanced regions holding 1024 shards.
func TestJoin1024(t *testing.T) {
	join := []Region{
		reg("a", "1.0.0", seq(0, 342)...),
		reg("b", "1.0.0", seq(342, 341)...),
		reg("c", "1.0.0", seq(683, 341)...),
		reg("d", "1.0.0"),
	}
	tests := []struct {
		name     string
		absolute int
		relative float64
		want     int
	}{
		{"unlimited", 1 << 30, 1.0, 1},
		{"relative 0.1 only", 1 << 30, 0.1, 3}, // 102 a round: 102+102+52
		{"Akka's limits", 20, 0.1, 13},         // 20 a round: 12*20+16
		{"defaults", DefaultAbsoluteLimit, DefaultRelativeLimit, 1},
	}
	for _, tc := range tests {
		got := simulate(t, NewLeastShard(tc.absolute, tc.relative), join, 100)
		t.Logf("1024 shards, 3->4 regions, limits %d/%g: balanced after %d rounds", tc.absolute, tc.relative, got)
		if got != tc.want {
			t.Errorf("%s: %d rounds, want %d", tc.name, got, tc.want)
		}
	}
}
