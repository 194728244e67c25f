package strategies

import (
	"cmp"
	"math"
	"slices"
	"strings"
)

// Defaults of LoadAwareConfig. The hysteresis keeps noisy measurements
// from moving shards back and forth; the limit on moves per round is high
// because natshard's handoff is cheap (a region joining three that hold
// 1 024 shards of equal load takes 256 moves: one round).
const (
	DefaultLoadHysteresis = 0.2
	DefaultLoadMaxMoves   = 256
)

// LoadAwareConfig configures NewLoadAware. The zero value is usable:
// message rates only, DefaultLoadHysteresis, DefaultLoadMaxMoves.
type LoadAwareConfig struct {
	// EntitiesWeight is what one live entity weighs, in messages per
	// second: a shard's load is MessagesPerSecond + EntitiesWeight*Entities.
	// 0 ignores entities; negative or NaN counts as 0.
	EntitiesWeight float64
	// Hysteresis is how far the most loaded region must be above the mean
	// before a round moves anything: 0.2 means by more than 20%. 0,
	// negative or NaN means DefaultLoadHysteresis; +Inf never rebalances.
	Hysteresis float64
	// MaxMoves is the most shards one round moves; 0 or negative means
	// DefaultLoadMaxMoves.
	MaxMoves int
}

// NewLoadAware returns a strategy that balances measured load rather than
// shard counts (Akka balances counts only).
//
// A shard's load is MessagesPerSecond + EntitiesWeight*Entities from the
// Load entry of its region, negative and NaN parts counting as 0. A shard
// with no entry (Load nil or shorter than Shards) counts as the mean of the
// shards with one, in all regions given, or as 1 when none has one. Loads
// are rounded to 1/1024 and capped at 2^30 messages per second so that sums
// are exact and the answer does not depend on the order of the regions. A
// region's load is the sum of its shards' loads; the mean is the load of
// all regions, leaving ones included, over the number of regions that are
// not leaving.
//
// Allocate picks, among the regions that are not leaving, the one with
// least load, then fewest shards, then newest version, then ID ascending.
// It does not know the load of the shard it places. With no region that
// is not leaving it returns an error wrapping ErrNoRegion.
//
// Rebalance returns nothing while any shard is in progress, while the
// regions that are not leaving run different versions, or unless the most
// loaded region that is not leaving is above mean*(1+Hysteresis).
// Otherwise it plans up to MaxMoves moves greedily: it takes the most
// loaded region M (ties: more shards, then ID ascending) and the region m
// that Allocate would pick, and moves M's hottest shard s (ties: oldest)
// for which load(m)+load(s) < load(M), so that the larger of the two
// loads goes down; it then updates both loads and goes on, until M has no
// such shard or MaxMoves moves are planned. Shards of zero load, shards
// already planned and shards of leaving regions never move.
//
// The round is then cut to its longest prefix that the coordinator
// reproduces: all returned shards leave their regions, then each is placed
// through Allocate in the returned order, whether or not its source region
// is offered, and must land where planned. (A moved shard is taken to keep
// its known load when all loads of its new region are known.) When all
// loads are known, or none is, the first move always lands as planned, and
// each applied move strictly lowers the sum of the squares of the region
// loads, so repeated rounds with the same loads end; and once the most
// loaded region is within the hysteresis band nothing moves at all. When only some loads are known,
// moving known shards changes the estimate of the others, so a round may
// be cut to nothing; rounds still end, as every round either lowers that
// sum or leaves fewer loads known.
//
// The strategy is stateless and safe for concurrent use.
func NewLoadAware(cfg LoadAwareConfig) Strategy {
	if !(cfg.EntitiesWeight > 0) {
		cfg.EntitiesWeight = 0
	}
	if !(cfg.Hysteresis > 0) {
		cfg.Hysteresis = DefaultLoadHysteresis
	}
	if cfg.MaxMoves <= 0 {
		cfg.MaxMoves = DefaultLoadMaxMoves
	}
	return loadAware{cfg}
}

type loadAware struct {
	cfg LoadAwareConfig
}

const (
	loadScale    = 1024    // fixed-point units per message per second
	maxShardLoad = 1 << 40 // 2^30 messages per second
)

// shardLoad is the load of one shard in fixed point.
func (s loadAware) shardLoad(l ShardLoad) int64 {
	v := l.MessagesPerSecond
	if !(v > 0) {
		v = 0
	}
	if l.Entities > 0 {
		v += s.cfg.EntitiesWeight * float64(l.Entities)
	}
	v = math.Round(v * loadScale)
	if !(v < maxShardLoad) {
		return maxShardLoad
	}
	return int64(v)
}

// slot is a region as the load-aware strategy sees it.
type slot struct {
	r     *Region
	loads []int64 // of r.Shards, the estimate for unknown ones
	load  int64   // their sum
	n     int     // number of shards
	tally tally
}

// tally is what a region holds: the sum and number of the known loads,
// and the number of unknown ones.
type tally struct {
	sum            int64
	known, unknown int
}

func (t tally) load(estimate int64) int64 { return t.sum + int64(t.unknown)*estimate }

// estimate is the load of a shard of unknown load: the mean of the known
// ones, or 1 when none is known.
func estimate(sum int64, known int) int64 {
	if known == 0 {
		return loadScale
	}
	return sum / int64(known)
}

// slots returns every region with its loads, and the tally of all of them.
func (s loadAware) slots(regions []Region) ([]slot, tally) {
	out := make([]slot, len(regions))
	var all tally
	for i := range regions {
		r := &regions[i]
		sl := &out[i]
		*sl = slot{r: r, loads: make([]int64, len(r.Shards)), n: len(r.Shards)}
		for j := range min(len(r.Load), len(r.Shards)) {
			sl.loads[j] = s.shardLoad(r.Load[j])
			sl.tally.sum += sl.loads[j]
			sl.tally.known++
		}
		sl.tally.unknown = sl.n - sl.tally.known
		all.sum += sl.tally.sum
		all.known += sl.tally.known
		all.unknown += sl.tally.unknown
	}
	e := estimate(all.sum, all.known)
	for i := range out {
		sl := &out[i]
		for j := sl.tally.known; j < sl.n; j++ {
			sl.loads[j] = e
		}
		sl.load = sl.tally.load(e)
	}
	return out, all
}

// lighter orders slots best target first, as Allocate does.
func lighter(a, b *slot) int {
	return cmp.Or(cmp.Compare(a.load, b.load), cmp.Compare(a.n, b.n),
		compareVersions(b.r.Version, a.r.Version), strings.Compare(a.r.ID, b.r.ID))
}

// heavier orders slots most loaded first.
func heavier(a, b *slot) int {
	return cmp.Or(cmp.Compare(b.load, a.load), cmp.Compare(b.n, a.n), strings.Compare(a.r.ID, b.r.ID))
}

// best returns the index of the first slot in order, skipping skip, or -1.
func best(slots []slot, order func(a, b *slot) int, skip int) int {
	at := -1
	for i := range slots {
		if i != skip && (at < 0 || order(&slots[i], &slots[at]) < 0) {
			at = i
		}
	}
	return at
}

func (s loadAware) Allocate(shard int, requester string, regions []Region) (string, error) {
	all, _ := s.slots(regions)
	var active []slot
	for _, sl := range all {
		if !sl.r.Leaving {
			active = append(active, sl)
		}
	}
	at := best(active, lighter, -1)
	if at < 0 {
		return "", noRegion(shard, regions)
	}
	return active[at].r.ID, nil
}

// move is a planned move between slots.
type move struct {
	shard    int
	load     int64
	known    bool // the load is known, not estimated
	from, to int
}

func (s loadAware) Rebalance(regions []Region, inProgress []int) ([]int, error) {
	if len(inProgress) > 0 {
		return nil, nil // one rebalance at a time
	}
	all, sum := s.slots(regions)
	total := sum.load(estimate(sum.sum, sum.known))
	var active []slot
	for _, sl := range all {
		if !sl.r.Leaving {
			active = append(active, sl)
		}
	}
	if len(active) == 0 || total == 0 {
		return nil, nil
	}
	for _, sl := range active[1:] {
		if compareVersions(sl.r.Version, active[0].r.Version) != 0 {
			return nil, nil // rolling update in progress
		}
	}
	top := active[best(active, heavier, -1)].load
	if float64(top)*float64(len(active)) <= float64(total)*(1+s.cfg.Hysteresis) {
		return nil, nil
	}
	plan := s.plan(active)
	for len(plan) > 0 && !(reproduces(active, sum, plan, true) && reproduces(active, sum, plan, false)) {
		plan = plan[:len(plan)-1]
	}
	if len(plan) == 0 {
		return nil, nil
	}
	out := make([]int, len(plan))
	for i, mv := range plan {
		out[i] = mv.shard
	}
	return out, nil
}

// plan picks the moves greedily; see NewLoadAware.
func (s loadAware) plan(active []slot) []move {
	slots := append([]slot(nil), active...)
	planned := map[int]bool{}
	var plan []move
	for len(plan) < s.cfg.MaxMoves {
		from, to := best(slots, heavier, -1), best(slots, lighter, -1)
		if from == to {
			break
		}
		M, m := &slots[from], &slots[to]
		pick := -1
		for j, sh := range M.r.Shards {
			l := M.loads[j]
			if l > 0 && !planned[sh] && m.load+l < M.load && (pick < 0 || l > M.loads[pick]) {
				pick = j
			}
		}
		if pick < 0 {
			break
		}
		mv := move{shard: M.r.Shards[pick], load: M.loads[pick], known: pick < M.tally.known, from: from, to: to}
		planned[mv.shard] = true
		plan = append(plan, mv)
		M.load, M.n = M.load-mv.load, M.n-1
		m.load, m.n = m.load+mv.load, m.n+1
	}
	return plan
}

// reproduces reports whether plan comes out as planned when all its shards
// first leave their regions and are then placed one by one, in order, on
// the region Allocate picks, excluding the source region when exclude is
// set. all is the tally of all regions, leaving ones included. A moved
// shard's load stays known when all loads of its new region are known, as
// Load can only leave the newest shards of a region unknown. Removing and
// placing shards of known load changes the estimate of the unknown ones,
// which is why the check is needed when loads are partly known.
func reproduces(active []slot, all tally, plan []move, exclude bool) bool {
	tallies := make([]tally, len(active))
	for i := range active {
		tallies[i] = active[i].tally
	}
	for _, mv := range plan {
		t := &tallies[mv.from]
		if mv.known {
			t.sum, t.known = t.sum-mv.load, t.known-1
			all.sum, all.known = all.sum-mv.load, all.known-1
		} else {
			t.unknown--
		}
	}
	slots := slices.Clone(active)
	for _, mv := range plan {
		skip, view := -1, all
		if exclude {
			// The source region is not offered at all: its known loads
			// do not count in the estimate either.
			skip = mv.from
			view.sum, view.known = view.sum-tallies[skip].sum, view.known-tallies[skip].known
		}
		e := estimate(view.sum, view.known)
		for i := range slots {
			slots[i].load, slots[i].n = tallies[i].load(e), tallies[i].known+tallies[i].unknown
		}
		if best(slots, lighter, skip) != mv.to {
			return false
		}
		t := &tallies[mv.to]
		if mv.known && t.unknown == 0 {
			t.sum, t.known = t.sum+mv.load, t.known+1
			all.sum, all.known = all.sum+mv.load, all.known+1
		} else {
			t.unknown++
		}
	}
	return true
}
