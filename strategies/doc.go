// Package strategies holds natshard's shard allocation strategies,
// modelled on Akka Cluster Sharding's.
//
// A Strategy is consulted by the coordinator. Allocate picks the region
// for a shard that has no owner; Rebalance picks shards to move off their
// current regions, which the coordinator then hands off and allocates
// again through Allocate. Strategies are pure: they use no clock,
// randomness, network or logging, give the same answer for the same input
// (whatever the order of the regions), and never modify their arguments.
//
// The strategies:
//
//   - NewLeastShard: Akka's least-shard strategy (2.6.10+), below;
//   - NewLegacyLeastShard: Akka's least-shard strategy before 2.6.10, with
//     a rebalance threshold and a cap on shards in flight;
//   - NewConsistentHashing: a hash ring over the regions, so that shards
//     keep their homes as regions come and go;
//   - NewExternal: shards pinned to regions by operators, the others left
//     to another strategy;
//   - NewLoadAware: balances the measured load of Region.Load rather than
//     shard counts, with hysteresis.
//
// docs/STRATEGIES.md in the repository walks through each with an example.
//
// # Least-shard strategy
//
// NewLeastShard is Akka's LeastShardAllocationStrategy as rewritten in
// Akka 2.6.10.
//
// Allocate orders regions by suitability and picks the first:
//
//  1. regions that are not leaving (a leaving region is never picked);
//  2. newest Version first: versions compare as dot-separated numbers
//     ("1.10.0" is newer than "1.9.3", a leading "v" is ignored), and
//     non-numeric or empty versions are older than any numeric one and
//     compare lexically among themselves;
//  3. fewest shards;
//  4. ID ascending.
//
// With no region that is not leaving it returns an error wrapping
// ErrNoRegion.
//
// Rebalance returns nothing while any shard is in progress (one rebalance
// at a time), while the regions that are not leaving run different
// versions (a rolling update), or when there are no such regions or no
// shards. Otherwise, with total the number of shards held by all regions,
// leaving ones included, and n the number of regions that are not leaving:
//
//	optimal = ceil(total / n)
//	limit   = max(1, min(floor(relativeLimit * total), absoluteLimit))
//
// Only regions that are not leaving are balanced: shards of leaving
// regions are never returned, as the coordinator moves them itself.
//
// Phase 1 goes through the regions most shards first (ties by ID) and
// takes the oldest len(Shards)-optimal shards of each region above
// optimal, stopping at limit shards.
//
// Because optimal is rounded up, every region can be at or below it while
// some are still two or more below. So when phase 1 finds nothing, phase 2
// counts the missing shards, the sum over regions of
// max(0, optimal-1-len(Shards)), and if that is not zero takes the oldest
// shard of each region holding exactly optimal shards (in ID order), up to
// min(missing, limit) shards.
//
// Shards are returned in the order they were selected, in a new slice.
//
// With limits high enough that a round is never cut short, any allocation
// is balanced (most and fewest shards differ by at most one) after at most
// two rounds: phase 1 brings every region down to optimal, and phase 2
// lifts those two or more below it. With the default limits a round moves
// at most 20 shards, so a region joining a large cluster fills up over
// many rounds.
package strategies
