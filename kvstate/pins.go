package kvstate

import (
	"context"
	"fmt"
	"strconv"

	"github.com/natshard/natshard/protocol"
)

// Pins are kept one key per pinned shard, pins.<shard>, with a protocol.Pin
// value. Only the coordinator writes them, fenced on its lease like the
// shard table: a new coordinator reads them after it took the lease, so it
// sees every pin write that was accepted, and none of a deposed one's can
// be accepted after that.

// PutPin pins shard to region, fenced on the coordinator lease (ErrFenced
// when fence is not the lease's current revision). region must be a valid
// name; it need not be registered.
func (s *Store) PutPin(ctx context.Context, fence Lease, shard int, region string) (uint64, error) {
	if err := checkFence(fence, "PutPin"); err != nil {
		return 0, err
	}
	if err := checkShard(shard); err != nil {
		return 0, err
	}
	if err := protocol.ValidateName("region id", region); err != nil {
		return 0, err
	}
	return s.fencedPut(ctx, fence, pinKey(shard), protocol.Pin{Shard: shard, Region: region}, fmt.Sprintf("pin shard %d", shard))
}

// DeletePin removes shard's pin, fenced on the coordinator lease. Removing
// a pin that does not exist succeeds.
func (s *Store) DeletePin(ctx context.Context, fence Lease, shard int) error {
	if err := checkFence(fence, "DeletePin"); err != nil {
		return err
	}
	if err := checkShard(shard); err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	s.fenceMu.lockFenced()
	defer s.fenceMu.unlockFenced()
	if err := s.tombstone(ctx, pinKey(shard), fence.Revision, true, KeyCoordinator); err != nil {
		return translate(fmt.Errorf("unpin shard %d fenced at coordinator revision %d: %w", shard, fence.Revision, err), ErrFenced)
	}
	return nil
}

// Pins reads every pin: shard -> region. Like Shards, it includes every
// write made before the call, and leaves out values that do not decode or
// whose shard is not the one of their key.
func (s *Store) Pins(ctx context.Context) (map[int]string, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	entries, err := s.list(ctx, prefixPins+">")
	if err != nil {
		return nil, translate(fmt.Errorf("list pins: %w", err), ErrConflict)
	}
	pins := make(map[int]string, len(entries))
	for _, e := range entries {
		var p protocol.Pin
		if protocol.Decode(e.Value(), &p) != nil || p.Shard < 0 || pinKey(p.Shard) != e.Key() || protocol.ValidateName("region id", p.Region) != nil {
			continue
		}
		pins[p.Shard] = p.Region
	}
	return pins, nil
}

func pinKey(shard int) string { return prefixPins + strconv.Itoa(shard) }

// checkFence refuses writes that are not fenced on a held coordinator lease.
func checkFence(fence Lease, op string) error {
	if fence.Key != KeyCoordinator {
		return fmt.Errorf("kvstate: %s fenced on %q, not on the coordinator lease", op, fence.Key)
	}
	if fence.Revision == 0 {
		return fmt.Errorf("%w: %s without a coordinator lease (revision 0)", ErrFenced, op)
	}
	return nil
}
