package kvstate

import (
	"context"
	"errors"
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
	status := s.nc.StatusChanged(nats.RECONNECTING, nats.DISCONNECTED, nats.CLOSED)
	start := func() (*snapshot, jetstream.KeyWatcher, error) { return s.startSnapshot(wctx, cancel, pattern) }
	sn, w, err := start()
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
		defer func() { stopWatcher(w) }()
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
		sn, w, err = s.settle(wctx, pattern, sn, w, start, status)
		if err != nil {
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
	start := func() (*snapshot, jetstream.KeyWatcher, error) { return s.startSnapshot(wctx, cancel, pattern) }
	sn, w, err := start()
	if err != nil {
		return nil, err
	}
	sn, w, err = s.settle(wctx, pattern, sn, w, start, nil)
	stopWatcher(w)
	if err != nil {
		return nil, err
	}
	return sn.live(), nil
}

// snapshot collects the initial values of a watch.
//
// A KV watch is an ordered consumer, which the server places on any replica
// of the bucket (createGroupForConsumer in nats-server picks a random peer,
// preferring those caught up with the cluster's metadata, not with the
// stream), and a follower applies a write some time after the leader
// acknowledged it: a watch's initial values may lack writes that
// completed before the watch began. Seen in tests on a three-server
// cluster: a listing right after a write often misses it. So before the
// watch begins, two things are read from the stream leader: the barrier,
// the last revision among the watched keys, and the keys that have a
// message. The snapshot is complete when the initial values, which the
// replica reads from its store as the watch begins, reach the barrier and
// hold every one of those keys.
//
// Waiting instead for any later update to reach the barrier is not
// enough, and missed keys: a replica that is behind, or
// that rebuilds its store from the leader's after a restart (keeping only
// what the leader still holds), may deliver another key's later value
// before it holds the key's value of the barrier's time, which history 1
// removed at the leader once the key was written again. A new
// coordinator's list of the regions missed a live one so, and took its
// shards while it served them (docs/FAULTS.md, core seed 50;
// TestListingWhileAReplicaCatchesUp). A watch whose initial values fall
// short is started again (settle).
//
// What this does not catch: a replica rebuilding its store may hold a
// key's value older than the barrier's time, when the key was written
// between the leader sending it and the barrier's read, a few
// milliseconds; a renewal, which keeps the value, is harmless.
type snapshot struct {
	barrier uint64
	keys    map[string]bool // the keys with a message at the leader as the watch began
	marker  bool            // the watcher's end-of-initial-values marker came
	initMax uint64          // highest revision among the initial values, tombstones included
	found   int             // how many of keys the initial values hold
	last    map[string]jetstream.KeyValueEntry
}

func (sn *snapshot) add(e jetstream.KeyValueEntry) {
	if e == nil {
		sn.marker = true
		return
	}
	old, seen := sn.last[e.Key()]
	if !sn.marker {
		sn.initMax = max(sn.initMax, e.Revision())
		if !seen && sn.keys[e.Key()] {
			sn.found++
		}
	}
	if !seen || e.Revision() > old.Revision() {
		sn.last[e.Key()] = e
	}
}

// complete: the initial values reached the barrier and hold every key.
func (sn *snapshot) complete() bool {
	return sn.marker && sn.initMax >= sn.barrier && sn.found == len(sn.keys)
}

// behind: the initial values are all in and fall short.
func (sn *snapshot) behind() bool { return sn.marker && !sn.complete() }

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

// startSnapshot reads the barrier of pattern and its keys from the stream
// leader, then starts a watcher of pattern that ends with ctx. When ctx has no
// deadline, starting the watcher is bounded by Options.Timeout, and cancel
// (ctx's) ends it then: the watcher's context must not carry that
// deadline, as its subscription ends when it does.
func (s *Store) startSnapshot(ctx context.Context, cancel context.CancelFunc, pattern string) (*snapshot, jetstream.KeyWatcher, error) {
	rctx, rcancel := s.ctx(ctx)
	keys, err := s.leaderKeys(rctx, pattern)
	var barrier uint64
	if err == nil {
		barrier, err = s.lastRev(rctx, pattern)
	}
	rcancel()
	if err != nil {
		return nil, nil, err
	}
	var timer *time.Timer
	if _, ok := ctx.Deadline(); !ok {
		timer = time.AfterFunc(s.opts.Timeout, cancel)
	}
	w, err := s.kv.Watch(ctx, pattern)
	if err == nil && timer != nil && !timer.Stop() {
		stopWatcher(w)
		err = context.DeadlineExceeded
	}
	if err != nil {
		return nil, nil, err
	}
	return &snapshot{barrier: barrier, keys: keys, last: map[string]jetstream.KeyValueEntry{}}, w, nil
}

// errBehind: the replica that served a watch was behind the barrier when
// the watch began (see snapshot).
var errBehind = errors.New("kvstate: the watch's replica was behind the stream leader")

// behindRetry is how long settle first waits before it starts a watch
// again, doubling up to behindRetryMax: a follower is usually a few
// milliseconds behind the leader, and the next watch may be placed on
// another replica.
const (
	behindRetry    = 10 * time.Millisecond
	behindRetryMax = 160 * time.Millisecond
)

// settle fills sn from w (see fill). When w's replica was behind, it
// starts the watch again with start, after a pause (behindRetry), until a
// snapshot is complete or ctx ends. It returns the snapshot and the
// watcher that made it, or, with an error, the watcher still running (nil
// if none) for the caller to stop.
func (s *Store) settle(ctx context.Context, pattern string, sn *snapshot, w jetstream.KeyWatcher, start func() (*snapshot, jetstream.KeyWatcher, error), lost <-chan nats.Status) (*snapshot, jetstream.KeyWatcher, error) {
	for pause := behindRetry; ; pause = min(2*pause, behindRetryMax) {
		err := s.fill(ctx, pattern, w, sn, lost)
		if !errors.Is(err, errBehind) {
			return sn, w, err
		}
		stopWatcher(w)
		w = nil
		if s.opts.Logger != nil {
			s.opts.Logger.Debug("watching again: the watch's replica was behind the stream leader", "keys", pattern, "barrier", sn.barrier, "reached", sn.initMax, "keys_held", sn.found, "keys_at_leader", len(sn.keys))
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-lost:
			return nil, nil, nats.ErrDisconnected
		case <-time.After(pause):
		}
		if sn, w, err = start(); err != nil {
			return nil, nil, err
		}
	}
}

// fill feeds sn the initial values of w. It fails when ctx ends, w's
// channel closes or lost (nil: never) delivers, and with errBehind when
// the initial values fall short (a key whose last message at the leader
// expired and went since, an expiry marker expiring itself, is short too:
// the next watch starts from the leader's keys of then).
func (s *Store) fill(ctx context.Context, pattern string, w jetstream.KeyWatcher, sn *snapshot, lost <-chan nats.Status) error {
	for !sn.marker {
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
		}
	}
	if sn.behind() {
		return errBehind
	}
	return nil
}

// stopWatcher stops w and drains its channel until it closes: the watcher's
// message handler blocks on a full channel, and only closes the channel
// after the handler returns.
func stopWatcher(w jetstream.KeyWatcher) {
	if w == nil {
		return
	}
	_ = w.Stop()
	go func() {
		for range w.Updates() {
		}
	}()
}
