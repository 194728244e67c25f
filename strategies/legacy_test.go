package strategies

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

func TestLegacyAllocate(t *testing.T) {
	tests := []struct {
		name    string
		regions []Region
		want    string
	}{
		{"fewest shards", []Region{reg("a", "", 1, 2), reg("b", "", 3), reg("c", "", 4, 5, 6)}, "b"},
		{"count beats version", []Region{reg("a", "2.0", 1, 2), reg("b", "1.0", 3)}, "b"},
		{"tie: newest version", []Region{reg("a", "1.0", 1), reg("b", "2.0", 2)}, "b"},
		{"tie: id", []Region{reg("c", "1.0", 1), reg("b", "1.0", 2), reg("a", "1.0", 3, 4)}, "b"},
		{"not leaving", []Region{leaving(reg("a", "")), reg("b", "", 1, 2, 3)}, "b"},
	}
	s := NewLegacyLeastShard(DefaultLegacyThreshold, DefaultLegacyMaxSimultaneous)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, regions := range [][]Region{tc.regions, reversed(tc.regions)} {
				if got, err := s.Allocate(9, "a", regions); err != nil || got != tc.want {
					t.Errorf("Allocate = %q, %v; want %q", got, err, tc.want)
				}
			}
		})
	}
	for _, regions := range [][]Region{nil, {leaving(reg("a", "", 1))}} {
		if id, err := s.Allocate(9, "a", regions); !errors.Is(err, ErrNoRegion) {
			t.Errorf("Allocate(%v) = %q, %v; want ErrNoRegion", regions, id, err)
		}
	}
}

func reversed(regions []Region) []Region {
	rev := slices.Clone(regions)
	slices.Reverse(rev)
	return rev
}

func TestLegacyRebalance(t *testing.T) {
	tests := []struct {
		name       string
		threshold  int
		maxSim     int
		regions    []Region
		inProgress []int
		want       []int
	}{
		// Gates.
		{"no regions", 1, 3, nil, nil, nil},
		{"all leaving", 1, 3, []Region{leaving(reg("a", "", seq(0, 9)...)), leaving(reg("b", ""))}, nil, nil},
		{"no shards", 1, 3, []Region{reg("a", ""), reg("b", "")}, nil, nil},
		{"in progress at the cap", 1, 3, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, []int{20, 21, 22}, nil},
		{"in progress above the cap", 1, 2, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, []int{20, 21, 22}, nil},
		{"in progress counted once", 1, 3, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, []int{20, 20, 20}, []int{0}},
		{"difference at threshold", 2, 10, []Region{reg("a", "", seq(0, 4)...), reg("b", "", 10, 11)}, nil, nil},
		{"threshold 0 never moves", 0, 10, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, nil, nil},
		{"max simultaneous 0 never moves", 1, 0, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, nil, nil},
		{"single region", 1, 3, []Region{reg("a", "", seq(0, 10)...)}, nil, nil},

		// How many: min(diff-threshold, threshold, maxSim-inProgress).
		{"threshold 1 moves one", 1, 3, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, nil, []int{0}},
		{"capped by threshold", 3, 10, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, nil, []int{0, 1, 2}},
		{"capped by diff-threshold", 3, 10, []Region{reg("a", "", seq(0, 5)...), reg("b", "")}, nil, []int{0, 1}},
		{"capped by max simultaneous", 5, 4, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, []int{100}, []int{0, 1, 2}},

		// Which: lowest numbers of the most loaded region, not in progress.
		{"lowest numbers, not oldest", 2, 10, []Region{reg("a", "", 9, 3, 7, 1, 5), reg("b", "")}, nil, []int{1, 3}},
		{"skips in progress", 2, 10, []Region{reg("a", "", 9, 3, 7, 1, 5, 0), reg("b", "")}, []int{1}, []int{0, 3}},
		{"most loaded counts shards not in progress", 1, 10,
			[]Region{reg("a", "", seq(0, 6)...), reg("b", "", seq(10, 5)...), reg("c", "")}, []int{0, 1, 2}, []int{10}},
		{"least loaded counts shards in progress", 3, 10,
			[]Region{reg("a", "", seq(0, 6)...), reg("b", "", 10, 11)}, []int{10}, []int{0}},
		{"most loaded ties by id", 1, 3, []Region{reg("b", "", seq(10, 4)...), reg("a", "", seq(0, 4)...), reg("c", "")}, nil, []int{0}},

		// Leaving regions are neither source nor least loaded.
		{"leaving not least loaded", 1, 3,
			[]Region{reg("a", "", seq(0, 4)...), reg("b", "", 10), leaving(reg("l", ""))}, nil, []int{0}},
		{"leaving not most loaded", 1, 3,
			[]Region{leaving(reg("l", "", seq(0, 10)...)), reg("a", "", 20), reg("b", "")}, nil, nil},

		// No version gate.
		{"mixed versions", 1, 3, []Region{reg("a", "1.0", seq(0, 4)...), reg("b", "2.0")}, nil, []int{0}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewLegacyLeastShard(tc.threshold, tc.maxSim)
			for _, regions := range [][]Region{tc.regions, reversed(tc.regions)} {
				got, err := s.Rebalance(regions, tc.inProgress)
				if err != nil || !reflect.DeepEqual(got, tc.want) {
					t.Errorf("Rebalance = %v, %v; want %v", got, err, tc.want)
				}
			}
		})
	}
}

// With threshold t and nothing in progress, rounds end with the most and
// fewest shards at most t apart.
func TestLegacySettles(t *testing.T) {
	for seed := range int64(100) {
		rng := newRand(seed)
		regions := randomAllocation(rng, 1+rng.Intn(10), rng.Intn(150))
		threshold := 1 + rng.Intn(4)
		s := NewLegacyLeastShard(threshold, 1+rng.Intn(5))
		for _, exclude := range []bool{false, true} {
			final, rounds := runRounds(t, s, regions, 500, exclude, nil)
			if spread(final) > threshold {
				t.Fatalf("seed %d: settled after %d rounds at %v, threshold %d", seed, rounds, sizes(final), threshold)
			}
		}
	}
	// Threshold 1 balances like the least-shard strategy, one shard a round.
	regions := []Region{reg("a", "", seq(0, 9)...), reg("b", ""), reg("c", "")}
	if got := simulate(t, NewLegacyLeastShard(1, 3), regions, 6); got != 6 {
		t.Errorf("9 shards onto 3 regions: %d rounds, want 6", got)
	}
}
