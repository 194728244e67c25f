package kvstate

import (
	"context"
	"fmt"
	"sort"
	"strconv"

	"github.com/natshard/natshard/protocol"
)

// PutShard writes one row of the shard table, fenced on the coordinator
// lease: the server refuses it (ErrFenced) unless the coordinator key's last
// revision is fence.Revision. Returns the row's new revision.
//
// The write carries Nats-Expected-Last-Subject-Sequence: fence.Revision and
// Nats-Expected-Last-Subject-Sequence-Subject: the coordinator key's
// subject. The server compares with the coordinator subject's last message,
// whatever it is: after a release, a deposition or an expiry that is a
// tombstone with a newer revision, after a takeover the new holder's lease;
// once an expiry marker is gone itself the subject is empty (revision 0).
// In every case the old fence no longer matches. fence must be the latest
// lease returned by AcquireCoordinator or Renew.
func (s *Store) PutShard(ctx context.Context, fence Lease, rec protocol.ShardRecord) (uint64, error) {
	if err := checkFence(fence, "PutShard"); err != nil {
		return 0, err
	}
	if err := checkShard(rec.Shard); err != nil {
		return 0, err
	}
	return s.fencedPut(ctx, fence, shardKey(rec.Shard), rec, fmt.Sprintf("put shard %d", rec.Shard))
}

// fencedPut writes v (msgpack) to key only while fence is the current
// coordinator lease; what names the write in errors.
func (s *Store) fencedPut(ctx context.Context, fence Lease, key string, v any, what string) (uint64, error) {
	data, err := protocol.Encode(v)
	if err != nil {
		return 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	s.fenceMu.lockFenced()
	defer s.fenceMu.unlockFenced()
	rev, err := s.cas(ctx, key, data, nil, KeyCoordinator, fence.Revision)
	if err != nil {
		return 0, translate(fmt.Errorf("%s fenced at coordinator revision %d: %w", what, fence.Revision, err), ErrFenced)
	}
	return rev, nil
}

// checkShard refuses a shard number no type can have.
func checkShard(n int) error {
	if n < 0 || n >= protocol.MaxShards {
		return fmt.Errorf("kvstate: shard %d out of range 0..%d", n, protocol.MaxShards-1)
	}
	return nil
}

// shardKey is the key of shard n's row.
func shardKey(n int) string { return prefixShards + strconv.Itoa(n) }

// Shards reads the whole shard table (rows that were never written are
// absent), ordered by shard.
//
// The table includes every write made before the call (it is read through
// a watch that is made to catch up with the stream leader, see snapshot).
// Rows that do not decode, or whose shard is not the one of their key, are
// left out (as if never written).
func (s *Store) Shards(ctx context.Context) ([]protocol.ShardRecord, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	entries, err := s.list(ctx, prefixShards+">")
	if err != nil {
		return nil, translate(fmt.Errorf("list shards: %w", err), ErrConflict)
	}
	out := make([]protocol.ShardRecord, 0, len(entries))
	for _, e := range entries {
		var rec protocol.ShardRecord
		if protocol.Decode(e.Value(), &rec) != nil || rec.Shard < 0 || shardKey(rec.Shard) != e.Key() {
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Shard < out[j].Shard })
	return out, nil
}
