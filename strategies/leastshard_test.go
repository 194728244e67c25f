package strategies

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

// seq returns n shards from first on.
func seq(first, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = first + i
	}
	return s
}

func reg(id, version string, shards ...int) Region {
	return Region{ID: id, Version: version, Shards: shards}
}

func leaving(r Region) Region {
	r.Leaving = true
	return r
}

func TestAllocate(t *testing.T) {
	tests := []struct {
		name    string
		regions []Region
		want    string
	}{
		{"single", []Region{reg("a", "")}, "a"},
		{"fewest shards", []Region{reg("a", "", 1, 2), reg("b", "", 3), reg("c", "", 4, 5, 6)}, "b"},
		{"empty region", []Region{reg("a", "", 1), reg("b", "")}, "b"},
		{"tie by id", []Region{reg("b", "", 1), reg("c", ""), reg("a", "")}, "a"},
		{"tie by id, shards", []Region{reg("z", "", 1, 2), reg("y", "", 3, 4)}, "y"},
		{"not leaving", []Region{leaving(reg("a", "")), reg("b", "", 1, 2, 3)}, "b"},
		{"leaving beats version", []Region{leaving(reg("a", "9.0.0")), reg("b", "1.0.0", 1)}, "b"},
		{"newest version", []Region{reg("a", "1.0.0"), reg("b", "1.1.0", 1, 2, 3)}, "b"},
		{"numeric version order", []Region{reg("a", "1.9.3"), reg("b", "1.10.0", 1, 2, 3)}, "b"},
		{"leading v ignored", []Region{reg("a", "1.9"), reg("b", "v1.10", 1, 2)}, "b"},
		{"equal versions, fewest", []Region{reg("a", "v1.2.0", 1), reg("b", "1.2")}, "b"},
		{"numeric beats empty", []Region{reg("a", ""), reg("b", "0.0.1", 1, 2)}, "b"},
		{"numeric beats non-numeric", []Region{reg("a", "zzz"), reg("b", "0.1", 1, 2)}, "b"},
		{"non-numeric lexical", []Region{reg("a", "alpha"), reg("b", "beta", 1, 2)}, "b"},
		{"version beats count", []Region{reg("a", "2.0", 1, 2, 3, 4), reg("b", "1.0"), reg("c", "2.0", 5, 6)}, "c"},
	}
	s := NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := s.Allocate(99, "a", tc.regions)
			if err != nil || got != tc.want {
				t.Errorf("Allocate = %q, %v; want %q", got, err, tc.want)
			}
			// The region order must not matter.
			rev := slices.Clone(tc.regions)
			slices.Reverse(rev)
			if got, err := s.Allocate(99, "a", rev); err != nil || got != tc.want {
				t.Errorf("Allocate (reversed) = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestAllocateIgnoresRequester(t *testing.T) {
	s := NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit)
	regions := []Region{reg("a", "", 1), reg("b", "")}
	for _, requester := range []string{"", "a", "b", "unknown"} {
		if got, _ := s.Allocate(7, requester, regions); got != "b" {
			t.Errorf("requester %q: Allocate = %q, want b", requester, got)
		}
	}
}

func TestAllocateNoRegion(t *testing.T) {
	s := NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit)
	for _, regions := range [][]Region{
		nil,
		{},
		{leaving(reg("a", ""))},
		{leaving(reg("a", "1.0")), leaving(reg("b", "2.0", 1))},
	} {
		id, err := s.Allocate(3, "a", regions)
		if !errors.Is(err, ErrNoRegion) || id != "" {
			t.Errorf("Allocate(%v) = %q, %v; want ErrNoRegion", regions, id, err)
		}
		if err != nil && err.Error() == ErrNoRegion.Error() {
			t.Errorf("error %q carries no detail", err)
		}
	}
}

func TestRebalance(t *testing.T) {
	high := NewLeastShard(1<<30, 1.0)
	tests := []struct {
		name       string
		s          Strategy
		regions    []Region
		inProgress []int
		want       []int
	}{
		// Gates.
		{"no regions", high, nil, nil, nil},
		{"no shards", high, []Region{reg("a", ""), reg("b", "")}, nil, nil},
		{"in progress", high, []Region{reg("a", "", seq(0, 10)...), reg("b", "")}, []int{42}, nil},
		{"differing versions", high, []Region{reg("a", "1.0", seq(0, 10)...), reg("b", "1.1")}, nil, nil},
		{"differing non-numeric versions", high, []Region{reg("a", "x", seq(0, 10)...), reg("b", "")}, nil, nil},
		{"all leaving", high, []Region{leaving(reg("a", "", seq(0, 10)...)), leaving(reg("b", ""))}, nil, nil},
		{"balanced", high, []Region{reg("a", "", 0, 1), reg("b", "", 2, 3)}, nil, nil},
		{"off by one", high, []Region{reg("a", "", 0, 1, 2), reg("b", "", 3, 4), reg("c", "", 5, 6)}, nil, nil},
		{"single region", high, []Region{reg("a", "", seq(0, 10)...)}, nil, nil},

		// Versions that compare equal do not block; leaving regions' versions do not count.
		{"equal versions", high, []Region{reg("a", "v1.2.0", seq(0, 4)...), reg("b", "1.2")}, nil, []int{0, 1}},
		{"leaving region's version ignored", high,
			[]Region{reg("a", "1.0", seq(0, 4)...), reg("b", "1.0"), leaving(reg("c", "0.9"))}, nil, []int{0, 1}},

		// Phase 1.
		{"phase 1 oldest first", high, []Region{reg("a", "", 9, 3, 7, 1), reg("b", "")}, nil, []int{9, 3}},
		{"phase 1 most shards first", high,
			[]Region{reg("a", "", seq(0, 4)...), reg("b", "", seq(4, 6)...), reg("c", ""), reg("d", "")},
			nil, []int{4, 5, 6, 0}},
		{"phase 1 ties by id", high,
			[]Region{reg("b", "", seq(5, 5)...), reg("a", "", seq(0, 5)...), reg("c", "")},
			nil, []int{0, 5}},
		{"phase 1 absolute limit", NewLeastShard(2, 1.0),
			[]Region{reg("a", "", seq(0, 4)...), reg("b", "", seq(4, 6)...), reg("c", ""), reg("d", "")},
			nil, []int{4, 5}},
		{"phase 1 relative limit", NewLeastShard(20, 0.1),
			[]Region{reg("a", "", seq(0, 100)...), reg("b", "")}, nil, seq(0, 10)},
		{"phase 1 Akka's limits", NewLeastShard(20, 0.1),
			[]Region{reg("a", "", seq(0, 1000)...), reg("b", "")}, nil, seq(0, 20)},
		{"phase 1 default limits: every excess shard", NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit),
			[]Region{reg("a", "", seq(0, 1000)...), reg("b", "")}, nil, seq(0, 500)},
		{"phase 1 limit at least one", NewLeastShard(20, 0.1),
			[]Region{reg("a", "", seq(0, 9)...), reg("b", "")}, nil, []int{0}},
		{"phase 1 zero limits", NewLeastShard(0, 0),
			[]Region{reg("a", "", seq(0, 9)...), reg("b", "")}, nil, []int{0}},
		{"phase 1 negative limits", NewLeastShard(-5, -1),
			[]Region{reg("a", "", seq(0, 9)...), reg("b", "")}, nil, []int{0}},

		// Phase 2: optimal 4, nobody above it, d two below.
		{"phase 2", high,
			[]Region{reg("c", "", seq(8, 4)...), reg("a", "", seq(0, 4)...), reg("b", "", seq(4, 4)...), reg("d", "", 12)},
			nil, []int{0, 4}},
		{"phase 2 limit", NewLeastShard(1, 1.0),
			[]Region{reg("c", "", seq(8, 4)...), reg("a", "", seq(0, 4)...), reg("b", "", seq(4, 4)...), reg("d", "", 12)},
			nil, []int{0}},
		{"phase 2 only regions at optimal", high,
			[]Region{reg("a", "", seq(0, 3)...), reg("b", "", seq(10, 4)...), reg("c", "", seq(20, 4)...), reg("d", "", seq(30, 4)...), reg("e", "", 40)},
			nil, []int{10, 20}},
		{"phase 2 nothing two below", high,
			[]Region{reg("a", "", seq(0, 4)...), reg("b", "", seq(4, 3)...), reg("c", "", seq(7, 3)...)}, nil, nil},

		// Leaving regions: their shards count in the total but are never returned.
		{"leaving shards count in total", high,
			[]Region{leaving(reg("l", "", seq(0, 4)...)), reg("a", "", seq(4, 4)...), reg("b", "")},
			nil, []int{4}},
		{"leaving shards not returned", high,
			[]Region{leaving(reg("l", "", seq(0, 10)...)), reg("a", "", seq(10, 15)...), reg("b", "")},
			nil, []int{10, 11}},
		{"leaving only region with shards", high,
			[]Region{leaving(reg("l", "", seq(0, 10)...)), reg("a", ""), reg("b", "")}, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.s.Rebalance(tc.regions, tc.inProgress)
			if err != nil {
				t.Fatalf("Rebalance: %v", err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Rebalance = %v, want %v", got, tc.want)
			}
			// The region order must not matter.
			rev := slices.Clone(tc.regions)
			slices.Reverse(rev)
			if got, _ := tc.s.Rebalance(rev, tc.inProgress); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Rebalance (reversed) = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestLimit(t *testing.T) {
	tests := []struct {
		absolute int
		relative float64
		total    int
		want     int
	}{
		{20, 0.1, 1024, 20},
		{20, 0.1, 150, 15},
		{20, 0.1, 159, 15}, // floor
		{20, 0.1, 5, 1},
		{1 << 30, 1.0, 1000, 1000},
		{1 << 30, 0.1, 1024, 102},
		{0, 1.0, 1000, 1},
		{20, 1e300, 1000, 20},
	}
	for _, tc := range tests {
		s := leastShard{tc.absolute, tc.relative}
		if got := s.limit(tc.total); got != tc.want {
			t.Errorf("limit(%d, %g, %d) = %d, want %d", tc.absolute, tc.relative, tc.total, got, tc.want)
		}
	}
}

func cloneRegions(regions []Region) []Region {
	out := slices.Clone(regions)
	for i := range out {
		out[i].Shards = slices.Clone(out[i].Shards)
		out[i].Load = slices.Clone(out[i].Load)
	}
	return out
}

func TestNoMutationAndNoAliasing(t *testing.T) {
	s := NewLeastShard(1<<30, 1.0)
	regions := []Region{
		reg("b", "1.0", seq(0, 10)...),
		reg("a", "1.0", seq(10, 2)...),
		reg("c", "1.0"),
		leaving(reg("d", "0.9", 12, 13)),
	}
	before := cloneRegions(regions)
	if _, err := s.Allocate(14, "a", regions); err != nil {
		t.Fatal(err)
	}
	got, err := s.Rebalance(regions, nil)
	if err != nil || len(got) == 0 {
		t.Fatalf("Rebalance = %v, %v", got, err)
	}
	for i := range got {
		got[i] = -1
	}
	if !reflect.DeepEqual(regions, before) {
		t.Errorf("inputs changed:\n got %v\nwant %v", regions, before)
	}
	inProgress := []int{3, 1, 2}
	if got, _ := s.Rebalance(regions, inProgress); got != nil {
		t.Errorf("Rebalance in progress = %v", got)
	}
	if !reflect.DeepEqual(inProgress, []int{3, 1, 2}) {
		t.Errorf("inProgress changed: %v", inProgress)
	}
}

func TestDeterministic(t *testing.T) {
	s := NewLeastShard(DefaultAbsoluteLimit, DefaultRelativeLimit)
	for seed := range int64(50) {
		regions := randomAllocation(newRand(seed), 1+int(seed%20), 200)
		firstID, firstErr := s.Allocate(1000, "", regions)
		first, _ := s.Rebalance(regions, nil)
		for range 3 {
			id, err := s.Allocate(1000, "", regions)
			again, _ := s.Rebalance(regions, nil)
			if id != firstID || err != firstErr || !reflect.DeepEqual(again, first) {
				t.Fatalf("seed %d: not deterministic: %q/%v vs %q/%v", seed, id, again, firstID, first)
			}
		}
		shuffled := cloneRegions(regions)
		newRand(seed+1000).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		id, _ := s.Allocate(1000, "", shuffled)
		again, _ := s.Rebalance(shuffled, nil)
		if id != firstID || !reflect.DeepEqual(again, first) {
			t.Fatalf("seed %d: depends on region order: %q/%v vs %q/%v", seed, id, again, firstID, first)
		}
	}
}
