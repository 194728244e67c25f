package kvstate

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// WatchCoordinator watches the coordinator lease. The channel closes when
// ctx ends or the watch is lost (connection loss); watch again then.
//
// The first event is the current lease if it is held, then comes a Synced
// marker, then every change: a new holder or a renewal with Info set, a
// release, deposition or expiry with Info nil. A lease value that does not
// decode is reported like a release (Info nil). The watch ends as soon as
// the connection is lost, even if it comes back: events may have been
// missed. The caller must keep reading the channel, or end ctx.
func (s *Store) WatchCoordinator(ctx context.Context) (<-chan CoordinatorEvent, error) {
	ch, err := watch(s, ctx, KeyCoordinator, func(e kvEvent) (CoordinatorEvent, bool) {
		if e.synced {
			return CoordinatorEvent{Synced: true}, true
		}
		ev := CoordinatorEvent{Revision: e.rev}
		if !e.deleted {
			var info protocol.CoordinatorInfo
			if protocol.Decode(e.value, &info) == nil {
				ev.Info = &info
			}
		}
		return ev, ev.Info != nil || e.afterSync
	})
	if err != nil {
		return nil, translate(fmt.Errorf("watch coordinator: %w", err), ErrConflict)
	}
	return ch, nil
}

// WatchRegions watches the registry: first the current registrations, then
// a Synced marker, then changes (expiry and removal arrive with Info nil).
// The channel closes when ctx ends or the watch is lost.
//
// A registration that does not decode, or whose id is not the one of its
// key, is reported like a removal (Info nil; left out before the Synced
// marker), as Regions leaves it out. The watch ends as soon as the
// connection is lost, even if it comes back. The caller must keep reading
// the channel, or end ctx.
func (s *Store) WatchRegions(ctx context.Context) (<-chan RegionEvent, error) {
	ch, err := watch(s, ctx, prefixRegions+">", func(e kvEvent) (RegionEvent, bool) {
		if e.synced {
			return RegionEvent{Synced: true}, true
		}
		id := strings.TrimPrefix(e.key, prefixRegions)
		ev := RegionEvent{ID: id, Revision: e.rev}
		if !e.deleted {
			var info protocol.RegionInfo
			if protocol.Decode(e.value, &info) == nil && info.ID == id {
				ev.Info = &info
			}
		}
		return ev, ev.Info != nil || e.afterSync
	})
	if err != nil {
		return nil, translate(fmt.Errorf("watch regions: %w", err), ErrConflict)
	}
	return ch, nil
}

// kvEvent is one entry of a KV watch.
type kvEvent struct {
	key       string
	value     []byte
	rev       uint64
	deleted   bool // tombstone: delete, purge, TTL expiry
	synced    bool // the marker after the initial values; other fields empty
	afterSync bool // a change after the marker, not an initial value
}

func toEvent(e jetstream.KeyValueEntry, afterSync bool) kvEvent {
	return kvEvent{
		key:       e.Key(),
		value:     e.Value(),
		rev:       e.Revision(),
		deleted:   e.Operation() != jetstream.KeyValuePut,
		afterSync: afterSync,
	}
}

// watch watches the keys matching pattern and delivers conv(event) for
// every event conv accepts: first the live keys (a snapshot, see fill), then
// the synced marker, then every change. The channel closes when ctx ends,
// when the watcher's subscription closes (connection closed) or when the
// connection is lost (reconnecting): an ordered consumer would resume after
// a reconnection, but whatever happened in between may be gone (expiry
// markers expire too), so the caller must watch again and start from the
// current state.
//
// Creating the watcher is bounded by Options.Timeout when ctx has no
// deadline. The watch's own context must not carry that deadline: the
// subscription ends when it does.
func watch[T any](s *Store, ctx context.Context, pattern string, conv func(kvEvent) (T, bool)) (<-chan T, error) {
	wctx, cancel := context.WithCancel(ctx)
	var timer *time.Timer
	if _, ok := ctx.Deadline(); !ok {
		timer = time.AfterFunc(s.opts.Timeout, cancel)
	}
	status := s.nc.StatusChanged(nats.RECONNECTING, nats.DISCONNECTED, nats.CLOSED)
	sn, w, err := s.startSnapshot(wctx, pattern)
	if err == nil && timer != nil && !timer.Stop() {
		stopWatcher(w)
		err = context.DeadlineExceeded
	}
	if err == nil && !s.nc.IsConnected() {
		stopWatcher(w)
		err = nats.ErrDisconnected
	}
	if err != nil {
		cancel()
		s.nc.RemoveStatusListener(status)
		return nil, err
	}

	out := make(chan T)
	go func() {
		defer close(out)
		defer cancel()
		defer s.nc.RemoveStatusListener(status)
		defer stopWatcher(w)
		send := func(ev kvEvent) bool {
			v, ok := conv(ev)
			if !ok {
				return true
			}
			select {
			case out <- v:
				return true
			case <-wctx.Done():
			case <-status:
			}
			return false
		}
		if s.fill(wctx, pattern, w, sn, status) != nil {
			return
		}
		for _, e := range sn.live() {
			if !send(toEvent(e, false)) {
				return
			}
		}
		if !send(kvEvent{synced: true}) {
			return
		}
		for {
			select {
			case <-wctx.Done():
				return
			case <-status:
				return
			case e, ok := <-w.Updates():
				if !ok {
					return
				}
				if e != nil && !send(toEvent(e, true)) {
					return
				}
			}
		}
	}()
	return out, nil
}

// list reads the live entries of the keys matching pattern, in revision
// order: a snapshot (see fill).
func (s *Store) list(ctx context.Context, pattern string) ([]jetstream.KeyValueEntry, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sn, w, err := s.startSnapshot(wctx, pattern)
	if err != nil {
		return nil, err
	}
	defer stopWatcher(w)
	if err := s.fill(wctx, pattern, w, sn, nil); err != nil {
		return nil, err
	}
	return sn.live(), nil
}

// snapshot collects the initial values of a watch.
//
// A KV watch is an ordered consumer, which the server places on any replica
// of the bucket (createGroupForConsumer in nats-server picks a random
// caught-up peer), and a follower applies a write some time after the
// leader acknowledged it: a watch's initial values may lack writes that
// completed before the watch began. Seen in tests on a three-server
// cluster: a listing right after a write often misses it. So the snapshot
// is not complete at the watcher's end-of-initial-values marker alone, but
// only once the watch has also delivered a revision at least as high as the
// barrier: the last revision among the watched keys, read from the stream
// leader before the watch began. A replica delivers in stream order, so
// then it has delivered everything up to the barrier.
type snapshot struct {
	barrier uint64
	marker  bool   // the watcher's end-of-initial-values marker came
	maxRev  uint64 // highest revision delivered, tombstones included
	last    map[string]jetstream.KeyValueEntry
}

func (sn *snapshot) add(e jetstream.KeyValueEntry) {
	if e == nil {
		sn.marker = true
		return
	}
	sn.maxRev = max(sn.maxRev, e.Revision())
	if old, ok := sn.last[e.Key()]; !ok || e.Revision() > old.Revision() {
		sn.last[e.Key()] = e
	}
}

func (sn *snapshot) complete() bool { return sn.marker && sn.maxRev >= sn.barrier }

// live is the snapshot's keys that are not deleted, in revision order.
func (sn *snapshot) live() []jetstream.KeyValueEntry {
	var out []jetstream.KeyValueEntry
	for _, e := range sn.last {
		if e.Operation() == jetstream.KeyValuePut {
			out = append(out, e)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Revision() < out[j].Revision() })
	return out
}

// startSnapshot reads the barrier of pattern from the stream leader, then
// starts a watcher of pattern that ends with ctx.
func (s *Store) startSnapshot(ctx context.Context, pattern string) (*snapshot, jetstream.KeyWatcher, error) {
	rctx, cancel := s.ctx(ctx)
	barrier, err := s.lastRev(rctx, pattern)
	cancel()
	if err != nil {
		return nil, nil, err
	}
	w, err := s.kv.Watch(ctx, pattern)
	if err != nil {
		return nil, nil, err
	}
	return &snapshot{barrier: barrier, last: map[string]jetstream.KeyValueEntry{}}, w, nil
}

// barrierRecheck is how often fill asks the leader again for the barrier
// while it waits for the watch to reach it.
const barrierRecheck = 100 * time.Millisecond

// fill feeds sn from w until sn is complete. It fails when ctx ends, w's
// channel closes or lost (nil: never) delivers.
//
// While it waits for the barrier, it reads it again from the leader now and
// then and lowers it if the message at the barrier is gone: an expiry
// marker expires itself, and a replica may drop it before delivering it.
func (s *Store) fill(ctx context.Context, pattern string, w jetstream.KeyWatcher, sn *snapshot, lost <-chan nats.Status) error {
	tick := time.NewTicker(barrierRecheck)
	defer tick.Stop()
	for !sn.complete() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-lost:
			return nats.ErrDisconnected
		case e, ok := <-w.Updates():
			if !ok {
				if err := ctx.Err(); err != nil {
					return err
				}
				return fmt.Errorf("%w: watch of %s ended before its initial values", nats.ErrConnectionClosed, pattern)
			}
			sn.add(e)
		case <-tick.C:
			if !sn.marker {
				continue
			}
			rctx, cancel := s.ctx(ctx)
			b, err := s.lastRev(rctx, pattern)
			cancel()
			if err == nil && b < sn.barrier {
				sn.barrier = b
			}
		}
	}
	return nil
}

// stopWatcher stops w and drains its channel until it closes: the watcher's
// message handler blocks on a full channel, and only closes the channel
// after the handler returns.
func stopWatcher(w jetstream.KeyWatcher) {
	_ = w.Stop()
	go func() {
		for range w.Updates() {
		}
	}()
}
