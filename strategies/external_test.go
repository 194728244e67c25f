package strategies

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

// spy is a fallback that records what it is given.
type spy struct {
	allocate string
	moves    []int
	err      error

	views      [][]Region
	inProgress [][]int
	requesters []string
}

func (s *spy) Allocate(shard int, requester string, regions []Region) (string, error) {
	s.views = append(s.views, cloneRegions(regions))
	s.requesters = append(s.requesters, requester)
	return s.allocate, s.err
}

func (s *spy) Rebalance(regions []Region, inProgress []int) ([]int, error) {
	s.views = append(s.views, cloneRegions(regions))
	s.inProgress = append(s.inProgress, slices.Clone(inProgress))
	return slices.Clone(s.moves), s.err
}

func TestExternalAllocate(t *testing.T) {
	regions := []Region{
		reg("a", "", 1, 2, 3),
		reg("b", "", 4),
		leaving(reg("l", "", 5)),
	}
	pins := map[int]string{1: "b", 10: "a", 11: "l", 12: "gone"}
	tests := []struct {
		name  string
		shard int
		want  string // "fallback" when the fallback decides
	}{
		{"pinned to a live region", 10, "a"},
		{"pinned to a live region, held elsewhere", 1, "b"},
		{"pinned to a leaving region", 11, "fallback"},
		{"pinned to a missing region", 12, "fallback"},
		{"not pinned", 13, "fallback"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fb := &spy{allocate: "fallback"}
			s := NewExternal(pins, fb)
			got, err := s.Allocate(tc.shard, "who", regions)
			if err != nil || got != tc.want {
				t.Fatalf("Allocate = %q, %v; want %q", got, err, tc.want)
			}
			if tc.want != "fallback" {
				if len(fb.views) != 0 {
					t.Errorf("fallback consulted for a pinned shard")
				}
				return
			}
			// The fallback sees every region, without shard 1 (pinned to b).
			want := []Region{reg("a", "", 2, 3), reg("b", "", 4), leaving(reg("l", "", 5))}
			if !reflect.DeepEqual(fb.views, [][]Region{want}) || fb.requesters[0] != "who" {
				t.Errorf("fallback saw %v (requester %q), want %v", fb.views, fb.requesters, want)
			}
		})
	}

	fb := &spy{err: errors.New("boom")}
	if _, err := NewExternal(nil, fb).Allocate(1, "", regions); err == nil || err.Error() != "boom" {
		t.Errorf("fallback error = %v, want boom", err)
	}
	if _, err := NewExternal(map[int]string{1: "a"}, nil).Allocate(1, "", []Region{leaving(reg("a", ""))}); !errors.Is(err, ErrNoRegion) {
		t.Errorf("every region leaving: %v, want ErrNoRegion", err)
	}
}

// The fallback's view drops pinned shards with their Load entries, known
// or not.
func TestExternalView(t *testing.T) {
	load := func(n float64) ShardLoad { return ShardLoad{MessagesPerSecond: n} }
	regions := []Region{
		{ID: "a", Shards: []int{1, 2, 3, 4}, Load: []ShardLoad{load(1), load(2), load(3)}},
		{ID: "b", Shards: []int{5, 6}, Load: []ShardLoad{load(5), load(6)}},
		{ID: "c", Shards: []int{7}},
	}
	fb := &spy{allocate: "c"}
	if _, err := NewExternal(map[int]string{2: "b", 4: "b", 6: "c"}, fb).Allocate(9, "", regions); err != nil {
		t.Fatal(err)
	}
	want := []Region{
		{ID: "a", Shards: []int{1, 3}, Load: []ShardLoad{load(1), load(3)}},
		{ID: "b", Shards: []int{5}, Load: []ShardLoad{load(5)}},
		{ID: "c", Shards: []int{7}},
	}
	if !reflect.DeepEqual(fb.views[0], want) {
		t.Errorf("fallback saw %+v\nwant %+v", fb.views[0], want)
	}
}

func TestExternalRebalance(t *testing.T) {
	regions := []Region{
		reg("a", "", 1, 2, 3, 20),
		reg("b", "", 4, 5, 21),
		leaving(reg("l", "", 6, 7)),
		reg("c", ""),
	}
	pins := map[int]string{
		1:  "b",    // on a: returned
		3:  "c",    // on a: returned
		4:  "b",    // at home
		5:  "a",    // on b: returned unless in progress
		6:  "a",    // on a leaving region: the coordinator moves it
		20: "l",    // pinned to a leaving region: the fallback's
		21: "gone", // pinned to a missing region: the fallback's
	}
	tests := []struct {
		name       string
		moves      []int // the fallback's
		inProgress []int
		want       []int
		sees       []Region // the fallback's view
	}{
		{"pinned shards elsewhere, ascending", nil, nil, []int{1, 3, 5}, nil},
		{"in progress left out", nil, []int{5, 99}, []int{1, 3}, nil},
		{"then the fallback's, in its order", []int{21, 2, 20}, nil, []int{1, 3, 5, 21, 2, 20}, nil},
		{"fallback's pinned and repeated shards dropped", []int{2, 4, 1, 2, 20}, nil, []int{1, 3, 5, 2, 20}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fb := &spy{moves: tc.moves}
			s := NewExternal(pins, fb)
			for _, rs := range [][]Region{regions, reversed(regions)} {
				got, err := s.Rebalance(rs, tc.inProgress)
				if err != nil || !reflect.DeepEqual(got, tc.want) {
					t.Errorf("Rebalance = %v, %v; want %v", got, err, tc.want)
				}
			}
			view := []Region{reg("a", "", 2, 20), reg("b", "", 21), leaving(reg("l", "", 7)), reg("c", "")}
			if !reflect.DeepEqual(fb.views[0], view) || !reflect.DeepEqual(fb.inProgress[0], tc.inProgress) {
				t.Errorf("fallback saw %v, %v; want %v, %v", fb.views[0], fb.inProgress[0], view, tc.inProgress)
			}
		})
	}

	fb := &spy{err: errors.New("boom")}
	if got, err := NewExternal(pins, fb).Rebalance(regions, nil); !errors.Is(err, fb.err) || got != nil {
		t.Errorf("fallback error: Rebalance = %v, %v", got, err)
	}
}

// Pins are copied: changing the caller's map afterwards changes nothing,
// and the strategy never changes it.
func TestExternalPinsCopied(t *testing.T) {
	pins := map[int]string{1: "b"}
	s := NewExternal(pins, nil)
	pins[1] = "a"
	pins[2] = "a"
	regions := []Region{reg("a", "", 1, 2), reg("b", "")}
	if got, _ := s.Allocate(1, "", regions); got != "b" {
		t.Errorf("Allocate(1) = %s, want b", got)
	}
	if got, _ := s.Rebalance(regions, nil); !reflect.DeepEqual(got, []int{1}) {
		t.Errorf("Rebalance = %v, want [1]", got)
	}
	if want := map[int]string{1: "a", 2: "a"}; !reflect.DeepEqual(pins, want) {
		t.Errorf("pins changed to %v", pins)
	}
	if NewExternal(nil, nil) == nil {
		t.Error("NewExternal(nil, nil) = nil")
	}
}

// With least-shard as fallback, pinned shards stay home and the others are
// balanced among themselves.
func TestExternalWithLeastShard(t *testing.T) {
	pins := map[int]string{}
	for sh := range 10 {
		pins[sh] = "a" // a holds ten pinned shards
	}
	s := NewExternal(pins, NewLeastShard(1<<30, 1))
	regions := []Region{reg("a", "", seq(0, 10)...), reg("b", "", seq(10, 6)...), reg("c", "")}
	// The fallback sees a: 0, b: 6, c: 0 shards, so new shards go to a.
	if got, _ := s.Allocate(99, "", regions); got != "a" {
		t.Errorf("Allocate(99) = %s, want a", got)
	}
	for _, exclude := range []bool{false, true} {
		final, _ := runRounds(t, s, regions, 10, exclude, nil)
		for _, r := range final {
			n := 0
			for _, sh := range r.Shards {
				if sh < 10 && r.ID != "a" {
					t.Errorf("pinned shard %d on %s", sh, r.ID)
				}
				if sh >= 10 {
					n++
				}
			}
			if n != 2 {
				t.Errorf("exclude=%v: %s holds %d unpinned shards of 6, want 2: %v", exclude, r.ID, n, sizes(final))
			}
		}
	}
}
