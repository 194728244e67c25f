package kvstate

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/natshard/natshard/protocol"
)

// A sharded daemon's type (natshard.Daemon) keeps its worker count under
// KeyDaemon, a protocol.Daemon; the key's presence is what makes the type
// a daemon. Its first host creates it; ScaleDaemon changes it; every host
// watches it (WatchDaemon) and starts or stops workers when it changes.

// KeyDaemon is the key of a daemon's worker count.
const KeyDaemon = "daemon"

// checkWorkers refuses a worker count out of range.
func checkWorkers(n int) error {
	if n < 0 || n > protocol.MaxWorkers {
		return fmt.Errorf("kvstate: %d workers, out of range 0..%d", n, protocol.MaxWorkers)
	}
	return nil
}

// EnsureDaemon stores workers as the daemon's count unless a count is
// stored already, and returns the stored count.
func (s *Store) EnsureDaemon(ctx context.Context, workers int) (int, error) {
	if err := checkWorkers(workers); err != nil {
		return 0, err
	}
	data, err := protocol.Encode(protocol.Daemon{Workers: workers})
	if err != nil {
		return 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	for {
		_, err := s.create(ctx, KeyDaemon, data, 0)
		if err == nil {
			return workers, nil
		}
		if !isWrongLastSeq(err) {
			return 0, translate(fmt.Errorf("store the daemon's workers: %w", err), ErrConflict)
		}
		n, _, err := s.DaemonWorkers(ctx)
		if errors.Is(err, ErrNotFound) {
			continue // deleted in between: create it again
		}
		return n, err
	}
}

// DaemonWorkers reads the daemon's worker count and its revision, from the
// stream leader; ErrNotFound when the type is not a daemon.
func (s *Store) DaemonWorkers(ctx context.Context) (int, uint64, error) {
	var d protocol.Daemon
	rev, err := s.loadDecoded(ctx, KeyDaemon, &d)
	if err != nil {
		return 0, 0, err
	}
	if err := checkWorkers(d.Workers); err != nil {
		return 0, 0, fmt.Errorf("%w: %s at revision %d: %w", ErrMalformed, KeyDaemon, rev, err)
	}
	return d.Workers, rev, nil
}

// ScaleDaemon sets the daemon's worker count: a compare-and-set on the
// revision it read, made again on a conflict (another count written
// meanwhile: the last write wins). ErrNotFound when the type is not a
// daemon (it never creates the key).
func (s *Store) ScaleDaemon(ctx context.Context, workers int) error {
	if err := checkWorkers(workers); err != nil {
		return err
	}
	data, err := protocol.Encode(protocol.Daemon{Workers: workers})
	if err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	for {
		// A malformed count is replaced, a missing one is not created.
		if _, _, err := s.DaemonWorkers(ctx); err != nil && !errors.Is(err, ErrMalformed) {
			return err
		}
		rev, err := s.lastRev(ctx, KeyDaemon)
		if err != nil {
			return translate(fmt.Errorf("scale the daemon: %w", err), ErrConflict)
		}
		_, err = s.cas(ctx, KeyDaemon, data, nil, KeyDaemon, rev)
		if err == nil {
			return nil
		}
		if !isWrongLastSeq(err) || ctx.Err() != nil {
			return translate(fmt.Errorf("scale the daemon to %d workers: %w", workers, err), ErrConflict)
		}
	}
}

// WatchDaemon watches the daemon's worker count: the stored one first, then
// every change. A value that does not decode, or is out of range, is left
// out. The channel closes when ctx ends or the watch is lost (the
// connection dropped): watch again then. The caller must keep reading the
// channel, or end ctx.
func (s *Store) WatchDaemon(ctx context.Context) (<-chan int, error) {
	ch, err := watch(s, ctx, KeyDaemon, func(e kvEvent) (int, bool) {
		if e.synced || e.deleted {
			return 0, false
		}
		var d protocol.Daemon
		if protocol.Decode(e.value, &d) != nil || checkWorkers(d.Workers) != nil {
			return 0, false
		}
		return d.Workers, true
	})
	if err != nil {
		return nil, translate(fmt.Errorf("watch the daemon's workers: %w", err), ErrConflict)
	}
	return ch, nil
}

// prefixWorkers is the prefix of the daemon's worker claims,
// workers.<index> (protocol.WorkerClaim).
const prefixWorkers = "workers."

// checkIndex refuses a worker index out of range.
func checkIndex(i int) error {
	if i < 0 || i >= protocol.MaxWorkers {
		return fmt.Errorf("kvstate: worker %d out of range 0..%d", i, protocol.MaxWorkers-1)
	}
	return nil
}

func workerKey(index int) string { return prefixWorkers + strconv.Itoa(index) }

// WorkerClaim reads the claim of worker index: nil when none is held, and
// the key's last revision, tombstones included (0: never written), which
// ClaimWorker compares with.
func (s *Store) WorkerClaim(ctx context.Context, index int) (*protocol.WorkerClaim, uint64, error) {
	if err := checkIndex(index); err != nil {
		return nil, 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	r, err := s.last(ctx, workerKey(index))
	switch {
	case apiCode(err) == codeNoMessage:
		return nil, 0, nil
	case err != nil:
		return nil, 0, translate(fmt.Errorf("read the claim of worker %d: %w", index, err), ErrConflict)
	case r.deleted:
		return nil, r.rev, nil
	}
	var c protocol.WorkerClaim
	if err := protocol.Decode(r.value, &c); err != nil {
		return nil, r.rev, fmt.Errorf("%w: the claim of worker %d at revision %d: %w", ErrMalformed, index, r.rev, err)
	}
	return &c, r.rev, nil
}

// ClaimWorker writes claim as worker index's if the key's last revision is
// still rev (ErrConflict otherwise), and returns the claim's revision.
func (s *Store) ClaimWorker(ctx context.Context, index int, claim protocol.WorkerClaim, rev uint64) (uint64, error) {
	if err := checkIndex(index); err != nil {
		return 0, err
	}
	data, err := protocol.Encode(claim)
	if err != nil {
		return 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	next, err := s.cas(ctx, workerKey(index), data, nil, workerKey(index), rev)
	if err != nil {
		return 0, translate(fmt.Errorf("claim worker %d: %w", index, err), ErrConflict)
	}
	return next, nil
}

// ReleaseWorker removes the claim of worker index written at revision rev,
// with a purge marker that expires; ErrConflict when the key was written
// since (another region claimed the worker).
func (s *Store) ReleaseWorker(ctx context.Context, index int, rev uint64) error {
	if err := checkIndex(index); err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if err := s.tombstone(ctx, workerKey(index), rev, true, workerKey(index)); err != nil {
		return translate(fmt.Errorf("release worker %d: %w", index, err), ErrConflict)
	}
	return nil
}
