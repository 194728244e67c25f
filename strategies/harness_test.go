package strategies

import (
	"fmt"
	"math/rand"
	"reflect"
	"slices"
	"testing"
)

// hop is one shard moved by a round.
type hop struct {
	shard    int
	from, to string
}

// applyRound applies a rebalance round as the coordinator does: the moved
// shards leave their regions (with their Load entries), then each is
// placed through Allocate in order, offered every region but its source
// when exclude is set. A shard keeps its Load entry when the target's
// loads are all known. It fails unless moved holds distinct shards of
// regions that are not leaving and Allocate picks a region offered that
// is not leaving.
func applyRound(t *testing.T, s Strategy, regions []Region, moved []int, exclude bool) ([]Region, []hop) {
	t.Helper()
	out := cloneRegions(regions)
	index := map[string]int{}
	where := map[int]int{}
	for i, r := range out {
		index[r.ID] = i
		for _, sh := range r.Shards {
			where[sh] = i
		}
	}
	hops := make([]hop, len(moved))
	loads := make([]*ShardLoad, len(moved))
	for k, sh := range moved {
		i, ok := where[sh]
		if !ok {
			t.Fatalf("moved %v: shard %d held by no region, or returned twice", moved, sh)
		}
		delete(where, sh)
		r := &out[i]
		if r.Leaving {
			t.Fatalf("moved %v: shard %d of leaving region %s", moved, sh, r.ID)
		}
		j := slices.Index(r.Shards, sh)
		r.Shards = slices.Delete(r.Shards, j, j+1)
		if j < len(r.Load) {
			l := r.Load[j]
			loads[k] = &l
			r.Load = slices.Delete(r.Load, j, j+1)
		}
		hops[k] = hop{shard: sh, from: r.ID}
	}
	for k, sh := range moved {
		view := out
		if exclude {
			view = slices.DeleteFunc(slices.Clone(out), func(r Region) bool { return r.ID == hops[k].from })
		}
		id, err := s.Allocate(sh, "", view)
		if err != nil {
			t.Fatalf("Allocate(%d): %v", sh, err)
		}
		i, ok := index[id]
		if !ok || out[i].Leaving || exclude && id == hops[k].from {
			t.Fatalf("Allocate(%d) = %q: not a region offered", sh, id)
		}
		r := &out[i]
		if loads[k] != nil && len(r.Load) == len(r.Shards) {
			r.Load = append(r.Load, *loads[k])
		}
		r.Shards = append(r.Shards, sh)
		hops[k].to = id
	}
	return out, hops
}

// runRounds applies rounds of s until Rebalance returns nothing, calling
// each (if not nil) after every round, and returns the final regions and
// the number of rounds; it fails after maxRounds rounds.
func runRounds(t *testing.T, s Strategy, regions []Region, maxRounds int, exclude bool, each func(before, after []Region, hops []hop)) ([]Region, int) {
	t.Helper()
	total := 0
	for _, r := range regions {
		total += len(r.Shards)
	}
	for round := 0; ; round++ {
		checkPlacement(t, regions, total)
		moved, err := s.Rebalance(regions, nil)
		if err != nil {
			t.Fatalf("round %d: %v", round+1, err)
		}
		if len(moved) == 0 {
			return regions, round
		}
		if round == maxRounds {
			t.Fatalf("still moving %v after %d rounds: %v", moved, round, sizes(regions))
		}
		next, hops := applyRound(t, s, regions, moved, exclude)
		if each != nil {
			each(regions, next, hops)
		}
		regions = next
	}
}

// randomRegions is randomAllocation with extras: some regions leaving,
// sometimes mixed versions, random loads, known for all, some or none of
// each region's shards.
func randomRegions(rng *rand.Rand, nRegions, nShards int) []Region {
	regions := randomAllocation(rng, nRegions, nShards)
	mixed := rng.Intn(4) == 0
	for i := range regions {
		r := &regions[i]
		r.Leaving = rng.Intn(5) == 0
		if mixed {
			r.Version = fmt.Sprintf("1.%d", rng.Intn(2))
		}
		known := len(r.Shards)
		switch rng.Intn(4) {
		case 0:
			known = 0
		case 1:
			known = rng.Intn(len(r.Shards) + 1)
		}
		for range known {
			r.Load = append(r.Load, randomLoad(rng))
		}
	}
	return regions
}

func randomLoad(rng *rand.Rand) ShardLoad {
	l := ShardLoad{MessagesPerSecond: rng.ExpFloat64() * 20, Entities: rng.Intn(50)}
	if rng.Intn(8) == 0 {
		l.MessagesPerSecond = 0
	}
	return l
}

// checkSame fails unless got equals want, which is what the caller passed
// in and kept a deep copy of.
func checkSame[T any](t *testing.T, what string, got, want T) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%s changed:\n got %v\nwant %v", what, got, want)
	}
}
