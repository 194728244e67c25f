package strategies

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"testing"
)

// lr returns region id holding shards first, first+1, ... with the given
// messages per second, all known.
func lr(id string, first int, mps ...float64) Region {
	r := Region{ID: id, Version: "1.0"}
	for i, m := range mps {
		r.Shards = append(r.Shards, first+i)
		r.Load = append(r.Load, ShardLoad{MessagesPerSecond: m})
	}
	return r
}

func withVersion(r Region, v string) Region {
	r.Version = v
	return r
}

func TestShardLoad(t *testing.T) {
	s := NewLoadAware(LoadAwareConfig{EntitiesWeight: 0.5}).(loadAware)
	tests := []struct {
		l    ShardLoad
		want int64
	}{
		{ShardLoad{}, 0},
		{ShardLoad{MessagesPerSecond: 1}, 1024},
		{ShardLoad{MessagesPerSecond: 2.5, Entities: 3}, 4 * 1024},
		{ShardLoad{MessagesPerSecond: 1.0 / 3}, 341}, // rounded to 1/1024
		{ShardLoad{MessagesPerSecond: -5, Entities: 2}, 1024},
		{ShardLoad{MessagesPerSecond: math.NaN(), Entities: -4}, 0},
		{ShardLoad{MessagesPerSecond: math.Inf(1)}, maxShardLoad},
		{ShardLoad{MessagesPerSecond: 1e300}, maxShardLoad},
	}
	for _, tc := range tests {
		if got := s.shardLoad(tc.l); got != tc.want {
			t.Errorf("shardLoad(%+v) = %d, want %d", tc.l, got, tc.want)
		}
	}
	for _, w := range []float64{0, -1, math.NaN()} {
		s := NewLoadAware(LoadAwareConfig{EntitiesWeight: w}).(loadAware)
		if got := s.shardLoad(ShardLoad{MessagesPerSecond: 1, Entities: 100}); got != 1024 {
			t.Errorf("weight %g: entities count, load %d", w, got)
		}
	}
}

func TestLoadAwareConfigDefaults(t *testing.T) {
	for _, cfg := range []LoadAwareConfig{{}, {Hysteresis: -1, MaxMoves: -3}, {Hysteresis: math.NaN()}} {
		got := NewLoadAware(cfg).(loadAware).cfg
		if got.Hysteresis != DefaultLoadHysteresis || got.MaxMoves != DefaultLoadMaxMoves || got.EntitiesWeight != 0 {
			t.Errorf("NewLoadAware(%+v) config %+v", cfg, got)
		}
	}
	cfg := LoadAwareConfig{EntitiesWeight: 0.25, Hysteresis: 0.5, MaxMoves: 3}
	if got := NewLoadAware(cfg).(loadAware).cfg; got != cfg {
		t.Errorf("NewLoadAware(%+v) config %+v", cfg, got)
	}
}

func TestLoadAwareAllocate(t *testing.T) {
	weighted := LoadAwareConfig{EntitiesWeight: 1}
	tests := []struct {
		name    string
		cfg     LoadAwareConfig
		regions []Region
		want    string
	}{
		{"least load, not fewest shards", LoadAwareConfig{}, []Region{lr("a", 0, 1, 1, 1), lr("b", 3, 10)}, "a"},
		{"tie: fewest shards", LoadAwareConfig{}, []Region{lr("a", 0, 5, 5), lr("b", 2, 10)}, "b"},
		{"tie: newest version", LoadAwareConfig{}, []Region{lr("a", 0, 10), withVersion(lr("b", 1, 10), "1.1")}, "b"},
		{"tie: id", LoadAwareConfig{}, []Region{lr("b", 0, 10), lr("a", 1, 10), lr("c", 2, 10)}, "a"},
		{"empty region", LoadAwareConfig{}, []Region{lr("a", 0, 0, 0), lr("b", 0)}, "b"},
		{"not leaving", LoadAwareConfig{}, []Region{leaving(lr("a", 0)), lr("b", 0, 100)}, "b"},
		{"unknown load is the mean of the known", LoadAwareConfig{},
			[]Region{{ID: "a", Shards: []int{0, 1}, Load: []ShardLoad{{MessagesPerSecond: 1}}}, lr("b", 2, 1.5)}, "b"},
		{"known loads of leaving regions count in the mean", LoadAwareConfig{},
			[]Region{{ID: "a", Shards: []int{0, 1}, Load: []ShardLoad{{MessagesPerSecond: 1}}}, lr("b", 2, 3), leaving(lr("l", 3, 0, 0, 0, 0))}, "a"},
		{"no load known: counts", LoadAwareConfig{}, []Region{reg("a", "", 0, 1, 2), reg("b", "", 3, 4)}, "b"},
		{"entities weigh", weighted, []Region{{ID: "a", Shards: []int{0}, Load: []ShardLoad{{MessagesPerSecond: 1, Entities: 10}}}, lr("b", 1, 5)}, "b"},
		{"entities ignored", LoadAwareConfig{}, []Region{{ID: "a", Shards: []int{0}, Load: []ShardLoad{{MessagesPerSecond: 1, Entities: 10}}}, lr("b", 1, 5)}, "a"},
		{"negative and NaN count as 0", LoadAwareConfig{}, []Region{lr("a", 0, -100, math.NaN()), lr("b", 2, 0.001)}, "a"},
		{"extra Load entries ignored", LoadAwareConfig{}, []Region{{ID: "a", Load: []ShardLoad{{MessagesPerSecond: 9}}}, lr("b", 0, 1)}, "a"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewLoadAware(tc.cfg)
			for _, regions := range [][]Region{tc.regions, reversed(tc.regions)} {
				if got, err := s.Allocate(99, "x", regions); err != nil || got != tc.want {
					t.Errorf("Allocate = %q, %v; want %q", got, err, tc.want)
				}
			}
		})
	}
	for _, regions := range [][]Region{nil, {leaving(lr("a", 0, 1))}} {
		if id, err := NewLoadAware(LoadAwareConfig{}).Allocate(1, "", regions); !errors.Is(err, ErrNoRegion) {
			t.Errorf("Allocate(%v) = %q, %v; want ErrNoRegion", regions, id, err)
		}
	}
}

func TestLoadAwareRebalance(t *testing.T) {
	def := LoadAwareConfig{}
	tests := []struct {
		name       string
		cfg        LoadAwareConfig
		regions    []Region
		inProgress []int
		want       []int
	}{
		// Gates.
		{"no regions", def, nil, nil, nil},
		{"all leaving", def, []Region{leaving(lr("a", 0, 9, 9)), leaving(lr("b", 0))}, nil, nil},
		{"in progress", def, []Region{lr("a", 0, 10, 10), lr("b", 0)}, []int{7}, nil},
		{"differing versions", def, []Region{lr("a", 0, 10, 10), withVersion(lr("b", 0), "2.0")}, nil, nil},
		{"no load at all", def, []Region{lr("a", 0, 0, 0, 0), lr("b", 0)}, nil, nil},
		{"within the band", def, []Region{lr("a", 0, 8, 3), lr("b", 2, 9)}, nil, nil},
		{"at the band's edge", def, []Region{lr("a", 0, 9, 3), lr("b", 2, 8)}, nil, nil},
		{"wider band", LoadAwareConfig{Hysteresis: 0.5}, []Region{lr("a", 0, 10, 3), lr("b", 2, 7)}, nil, nil},
		{"infinite band", LoadAwareConfig{Hysteresis: math.Inf(1)}, []Region{lr("a", 0, 10, 10), lr("b", 0)}, nil, nil},
		{"equal loads", def, []Region{lr("a", 0, 10, 10, 10), lr("b", 3, 30), lr("c", 4, 15, 15)}, nil, nil},

		// Moves.
		{"above the band: what fits", def, []Region{lr("a", 0, 10, 3), lr("b", 2, 7)}, nil, []int{1}},
		{"hottest first, oldest on ties", def, []Region{lr("a", 0, 50, 30, 10, 10), lr("b", 0), lr("c", 4, 20)}, nil, []int{0, 2}},
		{"then from whichever region is most loaded", def,
			[]Region{lr("a", 0, 40, 30, 20, 10), lr("b", 4, 10), lr("c", 5, 10)}, nil, []int{0, 1, 4}},
		{"never overshoots", def, []Region{lr("a", 0, 100), lr("b", 0)}, nil, nil},
		{"zero loads never move", def, []Region{lr("a", 0, 10, 0, 0, 0), lr("b", 0)}, nil, nil},
		{"max moves", LoadAwareConfig{MaxMoves: 2}, []Region{lr("a", 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), lr("b", 0), lr("c", 0), lr("d", 0)}, nil, []int{0, 1}},
		{"no load known: counts", def, []Region{reg("a", "1.0", 0, 1, 2, 3), reg("b", "1.0")}, nil, []int{0, 1}},
		{"entities weigh", LoadAwareConfig{EntitiesWeight: 0.1},
			[]Region{{ID: "a", Shards: []int{0, 1}, Load: []ShardLoad{{Entities: 100}, {Entities: 100}}}, reg("b", "")}, nil, []int{0}},
		{"entities ignored", def,
			[]Region{{ID: "a", Shards: []int{0, 1}, Load: []ShardLoad{{Entities: 100}, {Entities: 100}}}, reg("b", "")}, nil, nil},
		{"cut to what the coordinator reproduces", def, []Region{lr("a", 0, 2), lr("b", 1, 6, 8, 8), lr("c", 4, 3)}, nil, []int{2, 3}},

		// Leaving regions count in the mean, but are neither source nor target.
		{"leaving load raises the mean", def, []Region{lr("a", 0, 10, 10), lr("b", 2, 2), leaving(lr("l", 3, 30))}, nil, nil},
		{"without it", def, []Region{lr("a", 0, 10, 10), lr("b", 2, 2)}, nil, []int{0}},
		{"leaving region not a target", def, []Region{lr("a", 0, 10, 10), lr("b", 2, 12), leaving(lr("l", 0))}, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewLoadAware(tc.cfg)
			for _, regions := range [][]Region{tc.regions, reversed(tc.regions)} {
				got, err := s.Rebalance(regions, tc.inProgress)
				if err != nil || !reflect.DeepEqual(got, tc.want) {
					t.Errorf("Rebalance = %v, %v; want %v", got, err, tc.want)
				}
			}
		})
	}
}

// loadsOf returns the region loads, in the order of regions, as the
// strategy sees them.
func loadsOf(s loadAware, regions []Region) []int64 {
	slots, _ := s.slots(regions)
	out := make([]int64, len(slots))
	for i, sl := range slots {
		out[i] = sl.load
	}
	return out
}

func sumSquares(loads []int64) int64 {
	var sum int64
	for _, l := range loads {
		sum += l * l
	}
	return sum
}

// Rounds applied with the same loads come to a stop: with all loads known
// (or none), each round lowers the sum of the squared region loads, never
// raises the highest, and no shard ever goes back to a region it left;
// the rounds end within the hysteresis band or when the most loaded
// region has no shard that fits elsewhere. With some loads unknown, the
// rounds still end.
func TestLoadAwareSettles(t *testing.T) {
	configs := []LoadAwareConfig{
		{},
		{Hysteresis: 0.05, MaxMoves: 3},
		{Hysteresis: 1e-9, MaxMoves: 50, EntitiesWeight: 0.3},
		{Hysteresis: 0.5, MaxMoves: 1, EntitiesWeight: 1},
	}
	for seed := range int64(300) {
		rng := newRand(seed)
		nRegions, nShards := 2+rng.Intn(7), rng.Intn(100)
		regions := randomRegions(rng, nRegions, nShards)
		known := seed % 3 // 0: all loads known, 1: none, 2: some
		for i := range regions {
			r := &regions[i]
			r.Leaving, r.Version = false, "1.0"
			switch known {
			case 0:
				for len(r.Load) < len(r.Shards) {
					r.Load = append(r.Load, randomLoad(rng))
				}
			case 1:
				r.Load = nil
			}
		}
		for ci, cfg := range configs {
			s := NewLoadAware(cfg).(loadAware)
			for _, exclude := range []bool{false, true} {
				t.Run(fmt.Sprintf("%d/%d/exclude=%v", seed, ci, exclude), func(t *testing.T) {
					left := map[int][]string{}
					final, _ := runRounds(t, s, regions, 1000, exclude, func(before, after []Region, hops []hop) {
						if known == 2 {
							return
						}
						b, a := loadsOf(s, before), loadsOf(s, after)
						if sumSquares(a) >= sumSquares(b) || slices.Max(a) > slices.Max(b) {
							t.Fatalf("round %v: loads %v -> %v", hops, b, a)
						}
						for _, h := range hops {
							if slices.Contains(left[h.shard], h.to) {
								t.Fatalf("shard %d back on %s, which it left", h.shard, h.to)
							}
							left[h.shard] = append(left[h.shard], h.from)
						}
					})
					if known == 2 {
						return
					}
					slots, sum := s.slots(final)
					total := sum.load(estimate(sum.sum, sum.known))
					top := slices.Max(loadsOf(s, final))
					if within := float64(top)*float64(len(final)) <= float64(total)*(1+s.cfg.Hysteresis); !within && len(s.plan(slots)) != 0 {
						t.Fatalf("settled out of the band with moves left: %v", loadsOf(s, final))
					}
				})
			}
		}
	}
}

// A fourth region joins three that hold 1 024 shards of equal load: with
// the defaults one round balances them (256 moves), and the next moves
// nothing.
func TestLoadAwareJoin1024(t *testing.T) {
	var regions []Region
	for i, id := range []string{"a", "b", "c"} {
		r := Region{ID: id, Version: "1.0"}
		for sh := i; sh < 1024; sh += 3 {
			r.Shards = append(r.Shards, sh)
			r.Load = append(r.Load, ShardLoad{MessagesPerSecond: 10})
		}
		regions = append(regions, r)
	}
	regions = append(regions, Region{ID: "d", Version: "1.0"})
	s := NewLoadAware(LoadAwareConfig{})
	moved, _ := s.Rebalance(regions, nil)
	if len(moved) != 256 {
		t.Fatalf("first round moves %d shards, want 256", len(moved))
	}
	final, rounds := runRounds(t, s, regions, 10, true, nil)
	if rounds != 1 || spread(final) > 1 {
		t.Fatalf("%d rounds, shards per region %v; want 1 round, balanced", rounds, sizes(final))
	}
}

// Regions of equal load never move anything, whatever their shards.
func TestLoadAwareEqualLoads(t *testing.T) {
	for seed := range int64(100) {
		rng := newRand(seed)
		var regions []Region
		shard := 0
		for i := range 1 + rng.Intn(8) {
			r := Region{ID: fmt.Sprintf("r%d", i)}
			for left := 120; left > 0; {
				l := 1 + rng.Intn(left)
				r.Shards = append(r.Shards, shard)
				r.Load = append(r.Load, ShardLoad{MessagesPerSecond: float64(l)})
				shard++
				left -= l
			}
			regions = append(regions, r)
		}
		for _, cfg := range []LoadAwareConfig{{}, {Hysteresis: 1e-9}} {
			if got, _ := NewLoadAware(cfg).Rebalance(regions, nil); got != nil {
				t.Fatalf("seed %d: equal loads, yet Rebalance = %v", seed, got)
			}
		}
	}
}

func TestReproduces(t *testing.T) {
	s := NewLoadAware(LoadAwareConfig{}).(loadAware)
	regions := []Region{lr("a", 0, 2), lr("b", 1, 6, 8, 8), lr("c", 4, 3)}
	slots, all := s.slots(regions)
	plan := s.plan(slots)
	want := []move{
		{shard: 2, load: 8 * loadScale, known: true, from: 1, to: 0},
		{shard: 3, load: 8 * loadScale, known: true, from: 1, to: 2},
		{shard: 4, load: 3 * loadScale, known: true, from: 2, to: 1},
	}
	if !reflect.DeepEqual(plan, want) {
		t.Fatalf("plan = %+v, want %+v", plan, want)
	}
	// With all three gone, a 2, b 6, c 0: shard 2 would land on c.
	for _, exclude := range []bool{false, true} {
		if reproduces(slots, all, plan, exclude) {
			t.Errorf("exclude=%v: the whole plan reproduces", exclude)
		}
		if !reproduces(slots, all, plan[:2], exclude) {
			t.Errorf("exclude=%v: the first two moves do not reproduce", exclude)
		}
	}
}
