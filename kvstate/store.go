package kvstate

import (
	"context"
	"errors"
	"time"

	"github.com/natshard/natshard/protocol"
	"github.com/nats-io/nats.go/jetstream"
)

var errTODO = errors.New("kvstate: not implemented yet")

// Store is the JetStream KV bucket of one entity type. It is safe for
// concurrent use. Every method takes a context first; when the context has
// no deadline, Options.Timeout bounds the call.
type Store struct {
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	bucket string
	opts   Options
}

// RegionEntry is a registered region with the revision of its registration.
type RegionEntry struct {
	Info     protocol.RegionInfo
	Revision uint64
}

// RegionEvent is one change of the region registry seen by a watch.
type RegionEvent struct {
	ID       string
	Info     *protocol.RegionInfo // nil when the registration was deleted or expired
	Revision uint64
	Synced   bool // marker: the initial values have all been delivered; other fields empty
}

// CoordinatorEvent is one change of the coordinator lease seen by a watch.
type CoordinatorEvent struct {
	Info     *protocol.CoordinatorInfo // nil when released or expired
	Revision uint64
	Synced   bool
}

// Open creates or binds the bucket of type typ (BucketName) with per-key
// TTLs enabled (LimitMarkerTTL) and history 1.
func Open(ctx context.Context, js jetstream.JetStream, typ string, opts Options) (*Store, error) {
	return nil, errTODO
}

// Bucket is the bucket's name.
func (s *Store) Bucket() string { return s.bucket }

// EnsureConfig stores want if the bucket has no configuration yet and
// returns the stored one. It returns ErrConfigMismatch, naming both values,
// when the stored shard count differs from want's.
func (s *Store) EnsureConfig(ctx context.Context, want protocol.TypeConfig) (protocol.TypeConfig, error) {
	return protocol.TypeConfig{}, errTODO
}

// Config reads the stored configuration; ErrNotFound when there is none.
func (s *Store) Config(ctx context.Context) (protocol.TypeConfig, error) {
	return protocol.TypeConfig{}, errTODO
}

// AcquireCoordinator creates the coordinator lease with a TTL. It returns
// ErrConflict when the lease is held. The returned lease's Revision is the
// epoch of the new coordinator.
func (s *Store) AcquireCoordinator(ctx context.Context, info protocol.CoordinatorInfo, ttl time.Duration) (Lease, error) {
	return Lease{}, errTODO
}

// Coordinator reads the coordinator lease from the stream leader (never a
// stale follower). ErrNotFound when no one holds it.
func (s *Store) Coordinator(ctx context.Context) (protocol.CoordinatorInfo, uint64, error) {
	return protocol.CoordinatorInfo{}, 0, errTODO
}

// DeposeCoordinator deletes the coordinator lease if its revision is still
// rev (ErrConflict otherwise). Candidates use it when the holder is known to
// be gone; the holder's next renewal and fenced writes then fail.
func (s *Store) DeposeCoordinator(ctx context.Context, rev uint64) error {
	return errTODO
}

// WatchCoordinator watches the coordinator lease. The channel closes when
// ctx ends or the watch is lost (connection loss); watch again then.
func (s *Store) WatchCoordinator(ctx context.Context) (<-chan CoordinatorEvent, error) {
	return nil, errTODO
}

// Renew rewrites a held lease with value (msgpack-encoded) and a fresh TTL,
// if the key's last revision is still l.Revision. It returns the lease with
// the new revision, or ErrConflict when the lease was lost (expired, taken,
// deposed).
func (s *Store) Renew(ctx context.Context, l Lease, value any) (Lease, error) {
	return Lease{}, errTODO
}

// Release deletes a held lease if its revision is still l.Revision;
// ErrConflict when it was already lost.
func (s *Store) Release(ctx context.Context, l Lease) error {
	return errTODO
}

// RegisterRegion writes the region's registration with a TTL, replacing any
// earlier registration of the same id (a restarted process takes over its
// id; the old incarnation's next renewal fails).
func (s *Store) RegisterRegion(ctx context.Context, info protocol.RegionInfo, ttl time.Duration) (Lease, error) {
	return Lease{}, errTODO
}

// Regions lists the live registrations.
func (s *Store) Regions(ctx context.Context) ([]RegionEntry, error) {
	return nil, errTODO
}

// RemoveRegion deletes a registration if its revision is still rev
// (ErrConflict otherwise). The coordinator uses it for a region it found
// dead; the region, if it still runs, fails its next renewal and fences
// itself.
func (s *Store) RemoveRegion(ctx context.Context, id string, rev uint64) error {
	return errTODO
}

// WatchRegions watches the registry: first the current registrations, then
// a Synced marker, then changes (expiry and removal arrive with Info nil).
// The channel closes when ctx ends or the watch is lost.
func (s *Store) WatchRegions(ctx context.Context) (<-chan RegionEvent, error) {
	return nil, errTODO
}

// PutShard writes one row of the shard table, fenced on the coordinator
// lease: the server refuses it (ErrFenced) unless the coordinator key's last
// revision is fence.Revision. Returns the row's new revision.
func (s *Store) PutShard(ctx context.Context, fence Lease, rec protocol.ShardRecord) (uint64, error) {
	return 0, errTODO
}

// Shards reads the whole shard table (rows that were never written are
// absent).
func (s *Store) Shards(ctx context.Context) ([]protocol.ShardRecord, error) {
	return nil, errTODO
}

// LoadEntity reads an entity's persisted state from the stream leader.
// ErrNotFound when it has none.
func (s *Store) LoadEntity(ctx context.Context, id string) ([]byte, uint64, error) {
	return nil, 0, errTODO
}

// SaveEntity writes an entity's state if its revision is still rev (0: the
// entity has no state yet). ErrConflict otherwise. Returns the new revision.
func (s *Store) SaveEntity(ctx context.Context, id string, data []byte, rev uint64) (uint64, error) {
	return 0, errTODO
}

// DeleteEntity deletes an entity's state if its revision is still rev.
func (s *Store) DeleteEntity(ctx context.Context, id string, rev uint64) error {
	return errTODO
}

// EntityKey is the KV key of an entity's state: "entities." followed by the
// id with every byte outside [A-Za-z0-9._/-] written as "=XX" (hex, upper
// case), '=' included.
func EntityKey(id string) string { return prefixEntities + id }
