package strategies

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
)

// Default limits of NewLeastShard: none in effect (an absolute limit of
// 1<<16, the most shards a type can have, and a relative limit of 1), so
// that one round plans every move the balance needs (two rounds at most,
// the second for phase 2). natshard's handoff is cheap and loses nothing,
// and the coordinator bounds the moves in flight, not the moves per
// round. Akka's limits (20 per round, 10% of the shards) were made for
// handoffs that drop buffers and restart entities; they made 1 024 shards
// on three regions take 13 rounds (32 s) to rebalance when a fourth
// joined. NewLeastShard(20, 0.1) gives them back.
const (
	DefaultAbsoluteLimit = 1 << 16
	DefaultRelativeLimit = 1.0
)

// NewLeastShard returns Akka's least-shard allocation strategy (2.6.10+).
// Each rebalance round moves at most
// max(1, min(floor(relativeLimit*totalShards), absoluteLimit)) shards.
// The strategy is stateless and safe for concurrent use.
func NewLeastShard(absoluteLimit int, relativeLimit float64) Strategy {
	return leastShard{absolute: absoluteLimit, relative: relativeLimit}
}

type leastShard struct {
	absolute int
	relative float64
}

// Allocate returns the most suitable region (see suitability); the
// requester does not matter.
func (s leastShard) Allocate(shard int, requester string, regions []Region) (string, error) {
	best := -1
	for i := range regions {
		if regions[i].Leaving {
			continue
		}
		if best < 0 || suitability(&regions[i], &regions[best]) < 0 {
			best = i
		}
	}
	if best < 0 {
		return "", fmt.Errorf("%w: shard %d: none of %d regions accepts shards", ErrNoRegion, shard, len(regions))
	}
	return regions[best].ID, nil
}

// suitability orders regions best target first: not leaving, then newest
// version, then fewest shards, then ID ascending.
func suitability(a, b *Region) int {
	if a.Leaving != b.Leaving {
		if a.Leaving {
			return 1
		}
		return -1
	}
	if c := compareVersions(b.Version, a.Version); c != 0 {
		return c
	}
	return cmp.Or(cmp.Compare(len(a.Shards), len(b.Shards)), strings.Compare(a.ID, b.ID))
}

// Rebalance returns the shards to move off their regions, in the order
// they were selected, or nil when nothing should move.
func (s leastShard) Rebalance(regions []Region, inProgress []int) ([]int, error) {
	if len(inProgress) > 0 {
		return nil, nil // one rebalance at a time
	}
	total := 0
	var active []*Region
	pick := picker{seen: map[int]bool{}}
	for i := range regions {
		r := &regions[i]
		total += len(r.Shards)
		if !r.Leaving {
			active = append(active, r)
			continue
		}
		for _, sh := range r.Shards {
			pick.seen[sh] = true // the coordinator moves these itself
		}
	}
	if len(active) == 0 || total == 0 {
		return nil, nil
	}
	for _, r := range active[1:] {
		if compareVersions(r.Version, active[0].Version) != 0 {
			return nil, nil // rolling update in progress
		}
	}
	slices.SortFunc(active, func(a, b *Region) int {
		return cmp.Or(cmp.Compare(len(b.Shards), len(a.Shards)), strings.Compare(a.ID, b.ID))
	})
	optimal := (total + len(active) - 1) / len(active)
	pick.limit = s.limit(total)

	// Phase 1: the oldest shards above optimal, most loaded regions first.
	for _, r := range active {
		if excess := len(r.Shards) - optimal; excess > 0 {
			pick.add(r.Shards[:excess]...)
		}
	}
	if len(pick.out) > 0 {
		return pick.out, nil
	}

	// Phase 2: optimal is rounded up, so regions can all be at or below it
	// while some are two or more below. Move that many shards, one (the
	// oldest) from each region holding exactly optimal.
	below := 0
	for _, r := range active {
		below += max(0, optimal-1-len(r.Shards))
	}
	if below == 0 {
		return nil, nil
	}
	pick.limit = min(pick.limit, below)
	for _, r := range active {
		if len(r.Shards) == optimal {
			pick.add(r.Shards[0])
		}
	}
	return pick.out, nil
}

// limit is the most shards one round may move.
func (s leastShard) limit(total int) int {
	n := s.absolute
	r := s.relative * float64(total)
	if math.IsNaN(r) || r < 0 {
		r = 0
	}
	if r < float64(n) {
		n = int(r)
	}
	return max(1, n)
}

// picker collects distinct shards up to a limit.
type picker struct {
	out   []int
	seen  map[int]bool
	limit int
}

func (p *picker) add(shards ...int) {
	for _, sh := range shards {
		if len(p.out) >= p.limit {
			return
		}
		if !p.seen[sh] {
			p.seen[sh] = true
			p.out = append(p.out, sh)
		}
	}
}
