package strategies

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"reflect"
	"slices"
	"strconv"
	"testing"
)

func TestHashes(t *testing.T) {
	for _, in := range []string{"", "0", "17", "region-a#3", "é"} {
		h := fnv.New64a()
		h.Write([]byte(in))
		if got, want := fnv1a(fnvOffset, in), h.Sum64(); got != want {
			t.Errorf("fnv1a(%q) = %#x, want %#x", in, got, want)
		}
	}
	if got, want := shardHash(42), fmix64(fnv1a(fnvOffset, "42")); got != want {
		t.Errorf("shardHash(42) = %#x, want %#x", got, want)
	}
	if got, want := pointHash("a", 7), fmix64(fnv1a(fnvOffset, "a#7")); got != want {
		t.Errorf(`pointHash("a", 7) = %#x, want %#x`, got, want)
	}
	if got, want := shardHash(-3), fmix64(fnv1a(fnvOffset, "-3")); got != want {
		t.Errorf("shardHash(-3) = %#x, want %#x", got, want)
	}
}

// The ring must not change between releases: that would move shards when
// coordinators are upgraded.
func TestConsistentGolden(t *testing.T) {
	s := NewConsistentHashing(0, 0)
	owners := func(regions ...Region) string {
		out := ""
		for sh := range 12 {
			id, err := s.Allocate(sh, "", regions)
			if err != nil {
				t.Fatal(err)
			}
			out += id
		}
		return out
	}
	if got, want := owners(reg("a", ""), reg("b", "")), "bbabbaababab"; got != want {
		t.Errorf("owners on a, b = %s, want %s", got, want)
	}
	if got, want := owners(reg("a", ""), reg("b", ""), reg("c", "")), "bcabbaacacab"; got != want {
		t.Errorf("owners on a, b, c = %s, want %s", got, want)
	}
	if got, want := owners(reg("a", ""), reg("b", ""), leaving(reg("c", ""))), "bbabbaababab"; got != want {
		t.Errorf("owners on a, b, c leaving = %s, want %s", got, want)
	}
}

func TestConsistentRingMatchesAllocate(t *testing.T) {
	for seed := range int64(20) {
		rng := newRand(seed)
		s := consistentHashing{vnodes: 1 + rng.Intn(30)}
		regions := randomRegions(rng, 1+rng.Intn(10), 0)
		ring := s.ring(regions)
		for range 200 {
			sh := rng.Intn(1 << 20)
			id, err := s.Allocate(sh, "", regions)
			if len(ring) == 0 {
				if !errors.Is(err, ErrNoRegion) {
					t.Fatalf("Allocate with every region leaving = %q, %v", id, err)
				}
				continue
			}
			if want := ring.owner(sh); id != want || err != nil {
				t.Fatalf("seed %d shard %d: Allocate = %q, %v; ring owner %q", seed, sh, id, err, want)
			}
		}
	}
}

func TestRingOwner(t *testing.T) {
	ring := hashRing{{10, "a"}, {20, "b"}, {20, "c"}, {30, "d"}}
	for key, want := range map[uint64]string{0: "a", 10: "a", 11: "b", 20: "b", 21: "d", 30: "d", 31: "a", ^uint64(0): "a"} {
		if got := ring.at(key); got != want {
			t.Errorf("key %d: owner %s, want %s", key, got, want)
		}
	}
	// s.ring sorts equal hashes by region ID, so the smallest ID wins a tie.
	ring = consistentHashing{vnodes: 3}.ring([]Region{reg("b", ""), reg("a", ""), leaving(reg("c", ""))})
	if len(ring) != 6 || !slices.IsSortedFunc(ring, func(x, y ringPoint) int {
		return cmp.Or(cmp.Compare(x.hash, y.hash), cmp.Compare(x.id, y.id))
	}) {
		t.Errorf("ring not sorted or wrong size: %v", ring)
	}
}

func TestConsistentVirtualNodesDefault(t *testing.T) {
	regions := []Region{reg("a", ""), reg("b", ""), reg("c", "")}
	for _, v := range []int{0, -1} {
		for sh := range 200 {
			got, _ := NewConsistentHashing(v, 0).Allocate(sh, "", regions)
			want, _ := NewConsistentHashing(DefaultVirtualNodes, 0).Allocate(sh, "", regions)
			if got != want {
				t.Fatalf("virtualNodes %d, shard %d: %s, want %s", v, sh, got, want)
			}
		}
	}
}

// Each region's share of the shards stays near its fair share.
func TestConsistentSpread(t *testing.T) {
	s := NewConsistentHashing(0, 0)
	for _, n := range []int{2, 3, 5, 8} {
		var regions []Region
		for i := range n {
			regions = append(regions, reg(fmt.Sprintf("region-%d", i), ""))
		}
		count := map[string]int{}
		const shards = 4096
		for sh := range shards {
			id, _ := s.Allocate(sh, "", regions)
			count[id]++
		}
		for _, r := range regions {
			if share := float64(count[r.ID]) * float64(n) / shards; share < 0.7 || share > 1.3 {
				t.Errorf("%d regions: %s holds %d shards, %.2f of its fair share", n, r.ID, count[r.ID], share)
			}
		}
	}
}

// owners returns the ring owner of shards 0..n-1.
func owners(t *testing.T, s Strategy, regions []Region, n int) []string {
	t.Helper()
	out := make([]string, n)
	for sh := range out {
		id, err := s.Allocate(sh, "", regions)
		if err != nil {
			t.Fatal(err)
		}
		out[sh] = id
	}
	return out
}

// onOwners places shards 0..n-1 on their ring owners among regions.
func onOwners(t *testing.T, s Strategy, regions []Region, n int) []Region {
	t.Helper()
	out := cloneRegions(regions)
	for sh, id := range owners(t, s, regions, n) {
		i := slices.IndexFunc(out, func(r Region) bool { return r.ID == id })
		out[i].Shards = append(out[i].Shards, sh)
	}
	return out
}

// A region joining takes only the shards that land on its points, and a
// region leaving gives up only its own: no other shard changes owner.
func TestConsistentStable(t *testing.T) {
	const shards = 1000
	for seed := range int64(30) {
		rng := newRand(seed)
		s := NewConsistentHashing(1+rng.Intn(120), 0)
		var regions []Region
		for i := range 1 + rng.Intn(8) {
			regions = append(regions, reg("r"+strconv.Itoa(i)+"-"+strconv.Itoa(rng.Intn(1000)), ""))
		}
		before := owners(t, s, regions, shards)
		placed := onOwners(t, s, regions, shards)
		if got, _ := s.Rebalance(placed, nil); got != nil {
			t.Fatalf("seed %d: every shard on its owner, yet Rebalance = %v", seed, got)
		}

		// Join.
		joined := append(slices.Clone(placed), reg("joiner", ""))
		after := owners(t, s, joined, shards)
		var taken []int
		for sh := range shards {
			if after[sh] != before[sh] {
				if after[sh] != "joiner" {
					t.Fatalf("seed %d: joining moved shard %d from %s to %s", seed, sh, before[sh], after[sh])
				}
				taken = append(taken, sh)
			}
		}
		if got, _ := s.Rebalance(joined, nil); !reflect.DeepEqual(got, taken) {
			t.Fatalf("seed %d: after a join Rebalance = %v, want %v", seed, got, taken)
		}

		// Leave, and removal.
		gone := rng.Intn(len(placed))
		left := slices.Clone(placed)
		left[gone].Leaving = true
		if got, _ := s.Rebalance(left, nil); got != nil {
			t.Fatalf("seed %d: a region leaving, yet Rebalance = %v", seed, got)
		}
		removed := slices.Delete(slices.Clone(placed), gone, gone+1)
		for _, rs := range [][]Region{left, removed} {
			if len(removed) == 0 {
				break
			}
			after := owners(t, s, rs, shards)
			for sh := range shards {
				if before[sh] != placed[gone].ID && after[sh] != before[sh] {
					t.Fatalf("seed %d: %s leaving moved shard %d from %s to %s", seed, placed[gone].ID, sh, before[sh], after[sh])
				}
				if after[sh] == placed[gone].ID {
					t.Fatalf("seed %d: shard %d still owned by %s", seed, sh, placed[gone].ID)
				}
			}
		}
	}
}

func TestConsistentRebalance(t *testing.T) {
	s := NewConsistentHashing(0, 0)
	base := []Region{reg("a", ""), reg("b", ""), reg("c", "")}
	own := owners(t, s, base, 40)
	// wrong: shards 0..39 each on a region other than its owner.
	wrong := cloneRegions(base)
	for sh, id := range own {
		i := (slices.IndexFunc(base, func(r Region) bool { return r.ID == id }) + 1) % 3
		wrong[i].Shards = append(wrong[i].Shards, sh)
	}
	right := onOwners(t, s, base, 40)
	mixed := cloneRegions(right)
	mixed[0].Shards = append(mixed[0].Shards, 7, 3) // shards also elsewhere
	mixed[1].Shards = append(mixed[1].Shards, 7)
	leavingWrong := cloneRegions(wrong)
	leavingWrong[2].Leaving = true
	var want []int // of leavingWrong: shards not on c whose owner is not their region (c's owners move to a, b)
	for i := range 2 {
		for _, sh := range leavingWrong[i].Shards {
			if o, _ := s.Allocate(sh, "", leavingWrong); o != leavingWrong[i].ID {
				want = append(want, sh)
			}
		}
	}
	slices.Sort(want)

	tests := []struct {
		name       string
		s          Strategy
		regions    []Region
		inProgress []int
		want       []int
	}{
		{"no regions", s, nil, nil, nil},
		{"every shard on its owner", s, right, nil, nil},
		{"every shard elsewhere, ascending", s, wrong, nil, seq(0, 40)},
		{"in progress left out", s, wrong, []int{3, 5, 39, 99}, slices.DeleteFunc(seq(0, 40), func(sh int) bool { return sh == 3 || sh == 5 || sh == 39 })},
		{"limit keeps the lowest", NewConsistentHashing(0, 5), wrong, []int{1}, []int{0, 2, 3, 4, 5}},
		{"negative limit is no limit", NewConsistentHashing(0, -1), wrong, nil, seq(0, 40)},
		{"held twice, once wrongly", s, mixed, nil, mixedWant(t, s, mixed)},
		{"leaving region's shards left out", s, leavingWrong, nil, want},
		{"all leaving", s, []Region{leaving(reg("a", "", 1, 2))}, nil, nil},
		{"mixed versions do not block", s, []Region{reg("a", "1.0", wrong[0].Shards...), reg("b", "2.0", wrong[1].Shards...), reg("c", "1.0", wrong[2].Shards...)}, nil, seq(0, 40)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, regions := range [][]Region{tc.regions, reversed(tc.regions)} {
				got, err := tc.s.Rebalance(regions, tc.inProgress)
				if err != nil || !reflect.DeepEqual(got, tc.want) {
					t.Errorf("Rebalance = %v, %v; want %v", got, err, tc.want)
				}
			}
		})
	}
}

// mixedWant is the shards of regions not on their owner, ascending, once each.
func mixedWant(t *testing.T, s Strategy, regions []Region) []int {
	var out []int
	for _, r := range regions {
		for _, sh := range r.Shards {
			if id, _ := s.Allocate(sh, "", regions); id != r.ID && !slices.Contains(out, sh) {
				out = append(out, sh)
			}
		}
	}
	slices.Sort(out)
	if len(out) == 0 {
		t.Fatal("mixedWant: nothing misplaced")
	}
	return out
}

func TestConsistentAllocate(t *testing.T) {
	s := NewConsistentHashing(0, 0)
	regions := []Region{reg("a", "1.0", seq(0, 30)...), reg("b", "2.0"), leaving(reg("c", "3.0"))}
	for sh := range 50 {
		id, err := s.Allocate(sh, "c", regions)
		if err != nil || id == "c" {
			t.Fatalf("Allocate(%d) = %q, %v", sh, id, err)
		}
		// Neither shard counts, versions nor the requester matter.
		if other, _ := s.Allocate(sh, "a", []Region{reg("b", "9.0", seq(0, 50)...), reg("a", "")}); other != id {
			t.Fatalf("Allocate(%d) = %q, then %q", sh, id, other)
		}
	}
	if id, err := s.Allocate(1, "a", []Region{leaving(reg("a", ""))}); !errors.Is(err, ErrNoRegion) {
		t.Errorf("Allocate with every region leaving = %q, %v", id, err)
	}
}
