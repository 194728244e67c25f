package strategies

import (
	"errors"
	"fmt"
	"maps"
	"math/rand"
	"reflect"
	"slices"
	"testing"
)

// named is a strategy under test; pins is the map given to NewExternal.
type named struct {
	name string
	s    Strategy
	pins map[int]string
}

// allStrategies returns every strategy with a few parameter choices, the
// pins of the External ones drawn from rng over nShards shards and the
// region IDs of randomAllocation (and one that never exists).
func allStrategies(rng *rand.Rand, nRegions, nShards int) []named {
	pins := func() map[int]string {
		m := map[int]string{}
		for range rng.Intn(nShards/4 + 2) {
			m[rng.Intn(nShards+1)] = fmt.Sprintf("r%03d", rng.Intn(nRegions+1))
		}
		return m
	}
	p1, p2 := pins(), pins()
	return []named{
		{name: "least-shard", s: NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit)},
		{name: "least-shard unlimited", s: NewLeastShard(1<<30, 1)},
		{name: "legacy 1/3", s: NewLegacyLeastShard(DefaultLegacyThreshold, DefaultLegacyMaxSimultaneous)},
		{name: "legacy 3/10", s: NewLegacyLeastShard(3, 10)},
		{name: "consistent", s: NewConsistentHashing(0, 0)},
		{name: "consistent 10/5", s: NewConsistentHashing(10, 5)},
		{name: "external/least-shard", s: NewExternal(p1, nil), pins: p1},
		{name: "external/consistent", s: NewExternal(p2, NewConsistentHashing(20, 0)), pins: p2},
		{name: "load-aware", s: NewLoadAware(LoadAwareConfig{})},
		{name: "load-aware tuned", s: NewLoadAware(LoadAwareConfig{EntitiesWeight: 0.5, Hysteresis: 0.05, MaxMoves: 3})},
	}
}

// TestAllProperties checks every strategy on random inputs: Rebalance
// returns distinct shards held by regions that are not leaving and not in
// progress; a round applied leaves every shard on exactly one region;
// answers do not depend on repetition or on the order of the regions;
// inputs are never modified and outputs never alias them.
func TestAllProperties(t *testing.T) {
	for seed := range int64(150) {
		rng := newRand(seed)
		nRegions, nShards := 1+rng.Intn(10), rng.Intn(120)
		regions := randomRegions(rng, nRegions, nShards)
		var inProgress []int
		if rng.Intn(3) == 0 {
			for range 1 + rng.Intn(4) {
				inProgress = append(inProgress, rng.Intn(nShards+1))
			}
		}
		for _, st := range allStrategies(rng, nRegions, nShards) {
			t.Run(fmt.Sprintf("%d/%s", seed, st.name), func(t *testing.T) {
				checkProperties(t, st, regions, inProgress, rng.Int63())
			})
		}
	}
}

func checkProperties(t *testing.T, st named, regions []Region, inProgress []int, seed int64) {
	s := st.s
	keep, keepBusy, keepPins := cloneRegions(regions), slices.Clone(inProgress), maps.Clone(st.pins)
	shuffled := cloneRegions(regions)
	newRand(seed).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	nShards := 0
	open := 0
	for _, r := range regions {
		nShards += len(r.Shards)
		if !r.Leaving {
			open++
		}
	}

	for _, busy := range [][]int{inProgress, nil} {
		moved, err := s.Rebalance(regions, busy)
		if err != nil {
			t.Fatalf("Rebalance: %v", err)
		}
		for range 2 {
			if again, _ := s.Rebalance(regions, busy); !reflect.DeepEqual(again, moved) {
				t.Fatalf("Rebalance not deterministic: %v then %v", moved, again)
			}
		}
		if again, _ := s.Rebalance(shuffled, busy); !reflect.DeepEqual(again, moved) {
			t.Fatalf("Rebalance depends on region order: %v vs %v", moved, again)
		}
		held := map[int]bool{}
		for _, r := range regions {
			for _, sh := range r.Shards {
				held[sh] = !r.Leaving
			}
		}
		isBusy := setOf(busy)
		seen := map[int]bool{}
		for _, sh := range moved {
			if !held[sh] || isBusy[sh] || seen[sh] {
				t.Fatalf("Rebalance(in progress %v) = %v: shard %d not held by an open region, in progress or twice", busy, moved, sh)
			}
			seen[sh] = true
		}
		for i := range moved {
			moved[i] = -1 // the result must not alias the inputs
		}
	}
	checkSame(t, "regions", regions, keep)
	checkSame(t, "inProgress", inProgress, keepBusy)
	checkSame(t, "pins", st.pins, keepPins)

	for _, sh := range []int{0, 1, nShards / 2, nShards, nShards + 7} {
		id, err := s.Allocate(sh, "r000", regions)
		if open == 0 {
			if !errors.Is(err, ErrNoRegion) {
				t.Fatalf("Allocate(%d) with every region leaving = %q, %v", sh, id, err)
			}
			continue
		}
		if err != nil || !slices.ContainsFunc(regions, func(r Region) bool { return r.ID == id && !r.Leaving }) {
			t.Fatalf("Allocate(%d) = %q, %v: not an open region", sh, id, err)
		}
		if again, _ := s.Allocate(sh, "r001", shuffled); again != id {
			t.Fatalf("Allocate(%d) depends on region order or requester: %q vs %q", sh, id, again)
		}
	}
	checkSame(t, "regions", regions, keep)

	if open > 0 {
		for _, exclude := range []bool{false, true} {
			moved, _ := s.Rebalance(regions, nil)
			after, _ := applyRound(t, s, regions, moved, exclude)
			checkPlacement(t, after, nShards)
		}
	}
	checkSame(t, "regions", regions, keep)
}

// TestAllSettle checks that repeated rounds of every strategy come to a
// stop, whether or not Allocate is offered the source region.
func TestAllSettle(t *testing.T) {
	for seed := range int64(40) {
		rng := newRand(seed)
		nRegions, nShards := 1+rng.Intn(8), rng.Intn(80)
		regions := randomRegions(rng, nRegions, nShards)
		for i := range regions {
			regions[i].Leaving = false
			regions[i].Version = "1.0"
		}
		for _, st := range allStrategies(rng, nRegions, nShards) {
			for _, exclude := range []bool{false, true} {
				t.Run(fmt.Sprintf("%d/%s/exclude=%v", seed, st.name, exclude), func(t *testing.T) {
					runRounds(t, st.s, regions, 4*nShards+4, exclude, nil)
				})
			}
		}
	}
}
