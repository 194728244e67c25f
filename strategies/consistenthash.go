package strategies

import (
	"cmp"
	"slices"
	"strconv"
	"strings"
)

// DefaultVirtualNodes is the number of ring points per region that
// NewConsistentHashing uses when given 0. Akka uses 10; more points spread
// shards more evenly (each region's share varies by roughly
// 1/sqrt(virtualNodes)) at the cost of a larger ring.
const DefaultVirtualNodes = 100

// NewConsistentHashing returns a strategy that places each shard by
// consistent hashing, like Akka's ConsistentHashingShardAllocationStrategy.
//
// The ring holds virtualNodes points for each region that is not leaving;
// point i of region id sits at hash(id + "#" + i), i written in decimal
// from 0. A shard sits at hash(its number in decimal), and its ring owner
// is the region of the first point clockwise from there: the point with the
// smallest hash at or above the shard's, wrapping round to the smallest
// hash overall; points with the same hash go by region ID ascending. The
// hash is 64-bit FNV-1a followed by MurmurHash3's 64-bit finalizer
// (fmix64), which spreads consecutive numbers over the whole ring.
//
// A region's points do not depend on the other regions, so a region
// joining takes over only the shards that now land on its points, and a
// region leaving gives up only its own shards: no other shard changes
// owner.
//
// Allocate returns the shard's ring owner (the requester does not matter),
// or an error wrapping ErrNoRegion when every region is leaving.
//
// Rebalance returns, in ascending order, the shards held by a region that
// is not leaving and is not their ring owner, leaving out those in
// progress, at most rebalanceLimit of them (the lowest-numbered); 0 or less
// means no limit. Shards of leaving regions are never returned (the
// coordinator moves them itself), and rolling updates do not hold it back.
//
// virtualNodes below 1 means DefaultVirtualNodes. The strategy is
// stateless and safe for concurrent use; it ignores versions and loads.
func NewConsistentHashing(virtualNodes, rebalanceLimit int) Strategy {
	if virtualNodes < 1 {
		virtualNodes = DefaultVirtualNodes
	}
	return consistentHashing{vnodes: virtualNodes, limit: rebalanceLimit}
}

type consistentHashing struct {
	vnodes, limit int
}

func (s consistentHashing) Allocate(shard int, requester string, regions []Region) (string, error) {
	// One pass over the points instead of building the ring: the owner is
	// the point at the least clockwise distance from the shard.
	key := shardHash(shard)
	owner, best, found := "", uint64(0), false
	for i := range regions {
		r := &regions[i]
		if r.Leaving {
			continue
		}
		for v := range s.vnodes {
			d := pointHash(r.ID, v) - key // wraps round the ring
			if !found || d < best || d == best && r.ID < owner {
				owner, best, found = r.ID, d, true
			}
		}
	}
	if !found {
		return "", noRegion(shard, regions)
	}
	return owner, nil
}

func (s consistentHashing) Rebalance(regions []Region, inProgress []int) ([]int, error) {
	ring := s.ring(regions)
	if len(ring) == 0 {
		return nil, nil
	}
	busy := setOf(inProgress)
	var out []int
	for i := range regions {
		r := &regions[i]
		if r.Leaving {
			continue
		}
		for _, sh := range r.Shards {
			if !busy[sh] && ring.owner(sh) != r.ID {
				out = append(out, sh)
			}
		}
	}
	slices.Sort(out)
	out = slices.Compact(out)
	if s.limit > 0 && len(out) > s.limit {
		out = out[:s.limit]
	}
	return slices.Clip(out), nil
}

type ringPoint struct {
	hash uint64
	id   string
}

// hashRing is a ring's points sorted by hash, then region ID.
type hashRing []ringPoint

func (s consistentHashing) ring(regions []Region) hashRing {
	var ring hashRing
	for i := range regions {
		if r := &regions[i]; !r.Leaving {
			for v := range s.vnodes {
				ring = append(ring, ringPoint{pointHash(r.ID, v), r.ID})
			}
		}
	}
	slices.SortFunc(ring, func(a, b ringPoint) int {
		return cmp.Or(cmp.Compare(a.hash, b.hash), strings.Compare(a.id, b.id))
	})
	return ring
}

// owner returns the ring owner of shard.
func (ring hashRing) owner(shard int) string { return ring.at(shardHash(shard)) }

// at returns the region of the first point at or after key, wrapping round.
func (ring hashRing) at(key uint64) string {
	i, _ := slices.BinarySearchFunc(ring, key, func(p ringPoint, k uint64) int { return cmp.Compare(p.hash, k) })
	if i == len(ring) {
		i = 0
	}
	return ring[i].id
}

func shardHash(shard int) uint64 {
	var buf [20]byte
	return fmix64(fnv1a(fnvOffset, strconv.AppendInt(buf[:0], int64(shard), 10)))
}

func pointHash(id string, v int) uint64 {
	var buf [21]byte
	h := fnv1a(fnvOffset, id)
	return fmix64(fnv1a(h, strconv.AppendInt(append(buf[:0], '#'), int64(v), 10)))
}

const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func fnv1a[T string | []byte](h uint64, b T) uint64 {
	for i := 0; i < len(b); i++ {
		h ^= uint64(b[i])
		h *= fnvPrime
	}
	return h
}

// fmix64 is MurmurHash3's finalizer: every input bit affects every output bit.
func fmix64(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}
