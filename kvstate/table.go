package kvstate

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/internal/wait"
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

// MaxShardBatch bounds the rows of one PutShards: NATS's default bound
// on an atomic batch (a server's jetstream max_batch_size can lower it:
// PutShards then refuses with ErrBatchRefused, and Batches says no from
// then on).
const MaxShardBatch = 1000

// batchFrom is the fewest rows Batches has go as an atomic batch to a
// bucket of the given replicas. A replicated stream stages a batch in
// memory: two rows in one batch already cost less than one after another.
// A one-replica stream on file stages it in a file store of its own (to
// survive a hard kill), about 3 ms whatever the batch's size, against
// 41 µs for a row written alone: a batch pays from about 80 rows
// (BenchmarkPutShards; docs/bench-log/scaling.md).
func batchFrom(replicas int) int {
	if replicas > 1 {
		return 2
	}
	return 100
}

// PutShards writes rows of the shard table, at most MaxShardBatch, as one
// atomic batch: committed whole or not at all, with one check of the
// fence (as PutShard's) for all of them. Batches says when n rows cost
// less as a batch than one after another. On a bucket that takes no
// atomic batches (one made before NATS 2.12), or when the server refuses
// this one (its max_batch_size; the bucket near its byte limit:
// fencedBatch), nothing is written and the error wraps ErrBatchRefused:
// the caller writes the rows one at a time (PutShard), renewing its lease
// between them as it needs (a row alone took a quarter of a second under
// load).
func (s *Store) PutShards(ctx context.Context, fence Lease, recs []protocol.ShardRecord) error {
	if err := checkFence(fence, "PutShards"); err != nil {
		return err
	}
	if len(recs) > MaxShardBatch {
		return fmt.Errorf("kvstate: %d rows in one PutShards; at most %d", len(recs), MaxShardBatch)
	}
	for _, rec := range recs {
		if err := checkShard(rec.Shard); err != nil {
			return err
		}
	}
	if len(recs) == 0 {
		return nil
	}
	if !s.atomicBatches.Load() {
		return fmt.Errorf("put %d shards: the bucket takes no atomic batches: %w", len(recs), ErrBatchRefused)
	}
	msgs := make([]*nats.Msg, len(recs))
	for i, rec := range recs {
		data, err := protocol.Encode(rec)
		if err != nil {
			return err
		}
		msgs[i] = &nats.Msg{Subject: s.subject(shardKey(rec.Shard)), Data: data, Header: nats.Header{}}
	}
	return s.fencedBatch(ctx, fence, msgs)
}

// ErrBatchRefused: PutShards wrote none of its rows, because the bucket
// takes no atomic batches or the server refused these rows as one; write
// them one at a time (PutShard).
var ErrBatchRefused = errors.New("kvstate: the rows cannot go as one atomic batch; write them one at a time")

// Batches reports whether n rows are to be written as one atomic batch
// (PutShards: one round trip) rather than one after another (PutShard: a
// round trip each): never where the bucket takes no batches; from
// batchFrom rows; and from fewer when the rows written alone lately took
// so long that n of them would cost more than a batch's staging
// (batchStaging) on top of one round trip: under load a row alone took a
// quarter of a second, and the 22 rows of a killed region's 11 shards
// were written 6.5 s after it was found dead (1.1 s as one batch).
func (s *Store) Batches(n int) bool {
	if n < 2 || !s.atomicBatches.Load() {
		return false
	}
	return n >= s.batchFrom || time.Duration(n-1)*time.Duration(s.rowTime.Load()) > batchStaging
}

// batchStaging is what an atomic batch costs a one-replica bucket beyond
// its round trip: the server stages it in a file store of its own, about
// 3 ms (BenchmarkPutShards). At 41 µs a row alone (idle), that is the
// cost of about 75 rows, near batchFrom's 100.
const batchStaging = 3 * time.Millisecond

// rowWritten folds the time a row written alone took into s.rowTime
// (a moving average over about eight rows).
func (s *Store) rowWritten(d time.Duration) {
	old := s.rowTime.Load()
	if old == 0 {
		s.rowTime.Store(int64(d))
		return
	}
	s.rowTime.Store(old + (int64(d)-old)/8)
}

// fencedBatch publishes msgs as one atomic batch whose first message is
// checked against the coordinator key's revision fence.Revision: the
// server checks the batch at its commit, so the check holds for all. The
// messages before the last go without a reply; the last commits the
// batch and is acknowledged. A batch the server found incomplete (a
// message lost on the way, or too many batches in flight on the server:
// the first message, which has no reply, is where that is refused) was
// not written, and is sent again, up to three times.
//
// ErrBatchRefused when the rows must go one at a time: from then on if
// the server refuses atomic batches in the bucket, or batches this large
// (its max_batch_size), with a warning; this time if the bucket is near
// its byte limit (the server counts every message of a batch as added
// bytes, not as replacing its key's last value, as it does a single
// write's).
func (s *Store) fencedBatch(ctx context.Context, fence Lease, msgs []*nats.Msg) error {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	s.fenceMu.lockFenced()
	defer s.fenceMu.unlockFenced()
	s.setFence(msgs[0].Header, KeyCoordinator, fence.Revision)
	msgs[len(msgs)-1].Header.Set(hdrBatchCommit, "1")
	for incomplete := 0; ; incomplete++ {
		_, err := s.whileBusy(ctx, KeyCoordinator, fence.Revision, func() (uint64, error) {
			id := nuid.Next()
			for i, m := range msgs {
				m.Header.Set(hdrBatchID, id)
				m.Header.Set(hdrBatchSeq, strconv.Itoa(i+1))
				if i < len(msgs)-1 {
					if err := s.nc.PublishMsg(m); err != nil {
						return 0, err
					}
				}
			}
			return s.publish(ctx, msgs[len(msgs)-1])
		})
		switch code := apiCode(err); {
		case err == nil:
			return nil
		case code == codeBatchIncomplete && incomplete < 3:
			if !wait.Sleep(ctx, time.Duration(incomplete+1)*10*time.Millisecond) {
				return translate(fmt.Errorf("put %d shards: %w", len(msgs), ctx.Err()), ErrFenced)
			}
			continue
		case code == codeAtomicDisabled || code == codeBatchTooLarge:
			s.atomicBatches.Store(false)
			if s.opts.Logger != nil {
				s.opts.Logger.Warn("the type's KV bucket refuses atomic batches; the coordinator writes its shard table one row at a time", "bucket", s.bucket, "err", err)
			}
			fallthrough
		case noSpaceCause(err) != "":
			return fmt.Errorf("put %d shards: %w (%w)", len(msgs), ErrBatchRefused, err)
		}
		return translate(fmt.Errorf("put %d shards fenced at coordinator revision %d: %w", len(msgs), fence.Revision, err), ErrFenced)
	}
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
	start := time.Now()
	rev, err := s.cas(ctx, key, data, nil, KeyCoordinator, fence.Revision)
	if err != nil {
		return 0, translate(fmt.Errorf("%s fenced at coordinator revision %d: %w", what, fence.Revision, err), ErrFenced)
	}
	s.rowWritten(time.Since(start))
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
