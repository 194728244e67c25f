package kvstate

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// AcquireCoordinator creates the coordinator lease with a TTL. It returns
// ErrConflict when the lease is held. The returned lease's Revision is the
// epoch of the new coordinator.
//
// The TTL is rounded up to whole seconds (the returned Lease.TTL says to
// what); below one second it is refused.
func (s *Store) AcquireCoordinator(ctx context.Context, info protocol.CoordinatorInfo, ttl time.Duration) (Lease, error) {
	secs, err := ttlSeconds(ttl)
	if err != nil {
		return Lease{}, err
	}
	data, err := protocol.Encode(info)
	if err != nil {
		return Lease{}, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	rev, err := s.create(ctx, KeyCoordinator, data, secs)
	if err != nil {
		return Lease{}, translate(fmt.Errorf("acquire coordinator lease: %w", err), ErrConflict)
	}
	return Lease{Key: KeyCoordinator, Revision: rev, TTL: time.Duration(secs) * time.Second, value: data}, nil
}

// Coordinator reads the coordinator lease from the stream leader (never a
// stale follower). ErrNotFound when no one holds it.
func (s *Store) Coordinator(ctx context.Context) (protocol.CoordinatorInfo, uint64, error) {
	var c protocol.CoordinatorInfo
	rev, err := s.loadDecoded(ctx, KeyCoordinator, &c)
	if err != nil {
		return protocol.CoordinatorInfo{}, 0, err
	}
	return c, rev, nil
}

// DeposeCoordinator deletes the coordinator lease if its revision is still
// rev (ErrConflict otherwise). Candidates use it when the holder is known to
// be gone; the holder's next renewal and fenced writes then fail.
func (s *Store) DeposeCoordinator(ctx context.Context, rev uint64) error {
	if rev == 0 {
		return fmt.Errorf("%w: depose coordinator at revision 0", ErrConflict)
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	s.fenceMu.Lock()
	defer s.fenceMu.Unlock()
	if err := s.tombstone(ctx, KeyCoordinator, rev, false, KeyCoordinator); err != nil {
		return translate(fmt.Errorf("depose coordinator at revision %d: %w", rev, err), ErrConflict)
	}
	return nil
}

// Renew rewrites a held lease with value (msgpack-encoded) and a fresh TTL,
// if the key's last revision is still l.Revision. It returns the lease with
// the new revision, or ErrConflict when the lease was lost (expired, taken,
// deposed).
//
// kv.Update cannot renew a lease: it writes without a TTL, so the key would
// never expire again. Renew publishes to the key's subject with
// Nats-Expected-Last-Subject-Sequence and Nats-TTL instead. A lease keeps
// l.TTL (rounded up to whole seconds).
//
// Fenced writes (PutShard) must use the returned lease from then on: the
// fence is the coordinator key's revision, which a renewal changes.
func (s *Store) Renew(ctx context.Context, l Lease, value any) (Lease, error) {
	secs, err := ttlSeconds(l.TTL)
	if err != nil {
		return Lease{}, err
	}
	if l.Key == "" || l.Revision == 0 {
		return Lease{}, fmt.Errorf("%w: renew of a lease that was never held (key %q, revision %d)", ErrConflict, l.Key, l.Revision)
	}
	data, err := protocol.Encode(value)
	if err != nil {
		return Lease{}, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if l.Key == KeyCoordinator {
		s.fenceMu.Lock()
		defer s.fenceMu.Unlock()
	}
	hdr := nats.Header{}
	hdr.Set(jetstream.MsgTTLHeader, ttlHeader(secs))
	rev, err := s.cas(ctx, l.Key, data, hdr, l.Key, l.Revision)
	if isWrongLastSeq(err) {
		if later, ok := s.ownLater(ctx, l.Key, l.Revision, data); ok {
			rev, err = s.cas(ctx, l.Key, data, hdr, l.Key, later)
		}
	}
	if err != nil {
		return Lease{}, translate(fmt.Errorf("renew lease %s at revision %d: %w", l.Key, l.Revision, err), ErrConflict)
	}
	return Lease{Key: l.Key, Revision: rev, TTL: time.Duration(secs) * time.Second, value: data}, nil
}

// ownLater looks, after a compare-and-set at revision after was refused,
// for a write of the holder's own that it did not learn of: a renewal the
// server stored after the holder stopped waiting for its acknowledgement
// (a timeout during a leader election, a lost connection). Then the key's
// last message, at a later revision, is exactly data. Nobody else writes
// that value: the coordinator's carries its epoch, a region's its
// incarnation. ownLater returns that revision; false for anything else
// (expired, deleted, taken, or unreadable).
func (s *Store) ownLater(ctx context.Context, key string, after uint64, data []byte) (uint64, bool) {
	if len(data) == 0 {
		return 0, false
	}
	r, err := s.last(ctx, key)
	if err != nil || r.deleted || r.rev <= after || !bytes.Equal(r.value, data) {
		return 0, false
	}
	return r.rev, true
}

// Release deletes a held lease if its revision is still l.Revision;
// ErrConflict when it was already lost.
func (s *Store) Release(ctx context.Context, l Lease) error {
	if l.Key == "" || l.Revision == 0 {
		return fmt.Errorf("%w: release of a lease that was never held (key %q, revision %d)", ErrConflict, l.Key, l.Revision)
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if l.Key == KeyCoordinator {
		s.fenceMu.Lock()
		defer s.fenceMu.Unlock()
	}
	err := s.tombstone(ctx, l.Key, l.Revision, false, l.Key)
	if isWrongLastSeq(err) {
		if later, ok := s.ownLater(ctx, l.Key, l.Revision, l.value); ok {
			err = s.tombstone(ctx, l.Key, later, false, l.Key)
		}
	}
	if err != nil {
		return translate(fmt.Errorf("release lease %s at revision %d: %w", l.Key, l.Revision, err), ErrConflict)
	}
	return nil
}

// RegisterRegion writes the region's registration with a TTL, replacing any
// earlier registration of the same id (a restarted process takes over its
// id; the old incarnation's next renewal fails).
//
// info.ID must be a valid name (protocol.ValidateName). The TTL is rounded
// up to whole seconds; below one second it is refused. The lease is renewed
// with Renew.
func (s *Store) RegisterRegion(ctx context.Context, info protocol.RegionInfo, ttl time.Duration) (Lease, error) {
	if err := protocol.ValidateName("region id", info.ID); err != nil {
		return Lease{}, err
	}
	secs, err := ttlSeconds(ttl)
	if err != nil {
		return Lease{}, err
	}
	data, err := protocol.Encode(info)
	if err != nil {
		return Lease{}, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	key := prefixRegions + info.ID
	hdr := nats.Header{}
	hdr.Set(jetstream.MsgTTLHeader, ttlHeader(secs))
	rev, err := s.write(ctx, key, data, hdr)
	if err != nil {
		return Lease{}, translate(fmt.Errorf("register region %s: %w", info.ID, err), ErrConflict)
	}
	return Lease{Key: key, Revision: rev, TTL: time.Duration(secs) * time.Second, value: data}, nil
}

// Region reads the registration of region id from the stream leader, with
// its revision; ErrNotFound when there is none.
func (s *Store) Region(ctx context.Context, id string) (protocol.RegionInfo, uint64, error) {
	var info protocol.RegionInfo
	if err := protocol.ValidateName("region id", id); err != nil {
		return info, 0, err
	}
	rev, err := s.loadDecoded(ctx, prefixRegions+id, &info)
	return info, rev, err
}

// RemoveRegion deletes a registration if its revision is still rev
// (ErrConflict otherwise). The coordinator uses it for a region it found
// dead; the region, if it still runs, fails its next renewal and fences
// itself.
func (s *Store) RemoveRegion(ctx context.Context, id string, rev uint64) error {
	if err := protocol.ValidateName("region id", id); err != nil {
		return err
	}
	if rev == 0 {
		return fmt.Errorf("%w: remove region %s at revision 0", ErrConflict, id)
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	key := prefixRegions + id
	if err := s.tombstone(ctx, key, rev, false, key); err != nil {
		return translate(fmt.Errorf("remove region %s at revision %d: %w", id, rev, err), ErrConflict)
	}
	return nil
}

// Regions lists the live registrations, ordered by id.
//
// The list includes every change made before the call (it is read through
// a watch that is made to catch up with the stream leader, see snapshot).
// Registrations that do not decode, or whose id is not the one of their
// key, are left out.
func (s *Store) Regions(ctx context.Context) ([]RegionEntry, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	entries, err := s.list(ctx, prefixRegions+">")
	if err != nil {
		return nil, translate(fmt.Errorf("list regions: %w", err), ErrConflict)
	}
	out := make([]RegionEntry, 0, len(entries))
	for _, e := range entries {
		var info protocol.RegionInfo
		if protocol.Decode(e.Value(), &info) != nil || prefixRegions+info.ID != e.Key() {
			continue
		}
		out = append(out, RegionEntry{Info: info, Revision: e.Revision()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Info.ID < out[j].Info.ID })
	return out, nil
}
