package coordinator

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"time"

	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// This file holds the leader's watch of the region registry and the
// events it publishes about regions.

// watchRegions turns registry changes into core events. The returned
// channel closes when the watch is lost; the caller watches again.
func (l *leader) watchRegions(ctx context.Context) <-chan Event {
	out := make(chan Event)
	go func() {
		defer close(out)
		var events <-chan kvstate.RegionEvent
		for ctx.Err() == nil {
			var err error
			if events, err = l.cfg.Store.WatchRegions(ctx); err == nil {
				break
			}
			l.log.Warn("cannot watch regions; retrying", "err", err)
			wait.Sleep(ctx, time.Second)
		}
		if events == nil {
			return // ctx ended before a watch began (ranging over nil would block for ever)
		}
		var ids []string
		synced := false
		for ev := range events {
			var e Event
			switch {
			case ev.Synced:
				synced = true
				e = RegionsSynced{IDs: ids}
			case ev.Info == nil:
				e = RegionGone{ID: ev.ID}
			default:
				if !synced {
					ids = append(ids, ev.ID)
				}
				e = RegionUp{RegionSeen{Info: *ev.Info, Revision: ev.Revision}}
			}
			select {
			case out <- e:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// publish announces ev on the events subject (core NATS: nobody may be
// listening, and a slow watcher may miss events).
func (l *leader) publish(ev protocol.Event) {
	ev.Time = time.Now().UTC().Format(time.RFC3339Nano)
	ev.Epoch = l.core.Epoch()
	data, err := json.Marshal(ev)
	if err == nil {
		err = l.cfg.Conn.Publish(l.cfg.Subjects.Events(), data)
	}
	if err != nil {
		l.log.Debug("cannot publish an event", "kind", ev.Kind, "err", err)
	}
}

// announceRegions logs and publishes the regions that registered, started
// leaving or are gone since the last call; acts are the actions of the
// step that changed them.
func (l *leader) announceRegions(acts []Action) {
	now := map[string]protocol.RegionInfo{}
	for _, r := range l.core.Regions() {
		now[r.Info.ID] = r.Info
		old, ok := l.seen[r.Info.ID]
		switch {
		case ok && old.Incarnation != r.Info.Incarnation:
			// The process behind the id restarted, or the region fenced
			// itself and registered again, empty.
			l.log.Info("region registered as a new incarnation: the old one's shards are re-homed", "region", r.Info.ID, "incarnation", r.Info.Incarnation, "was", old.Incarnation)
			l.publish(protocol.Event{Kind: protocol.EventRegionGone, Region: r.Info.ID})
			l.publish(protocol.Event{Kind: protocol.EventRegionUp, Region: r.Info.ID})
			if r.Info.Leaving {
				l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
			}
		case !ok:
			l.log.Info("region joined", "region", r.Info.ID, "incarnation", r.Info.Incarnation, "version", r.Info.Version, "leaving", r.Info.Leaving)
			l.publish(protocol.Event{Kind: protocol.EventRegionUp, Region: r.Info.ID})
			if r.Info.Leaving {
				l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
			}
		case r.Info.Leaving && !old.Leaving:
			l.log.Info("region leaving: its shards are handed off", "region", r.Info.ID)
			l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
		case !r.Info.Leaving && old.Leaving:
			l.log.Info("region undrained: it takes shards again", "region", r.Info.ID)
			l.publish(protocol.Event{Kind: protocol.EventUndrained, Region: r.Info.ID})
		}
	}
	for _, id := range slices.Sorted(maps.Keys(l.seen)) {
		if _, ok := now[id]; !ok {
			why := "its registration expired or was deleted"
			if l.removed[id] {
				why = "found dead: no responders on its command subject"
				delete(l.removed, id)
			}
			l.log.Info("region gone: its shards are re-homed", "region", id, "why", why)
			l.publish(protocol.Event{Kind: protocol.EventRegionGone, Region: id})
		}
	}
	l.seen = now
}
