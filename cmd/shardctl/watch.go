package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// cmdWatch prints the coordinator's events as they come: one line each, or
// with --json the event itself (one JSON object per line). It subscribes
// to the events subject, so it sees what happens while it runs, at most
// once (core NATS): a watcher too slow to keep up loses events, and says
// so.
func cmdWatch(ctx context.Context, c *client, _ []string, out io.Writer) error {
	msgs := make(chan *nats.Msg, 1024)
	sub, err := c.nc.ChanSubscribe(c.subjects.Events(), msgs)
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", c.subjects.Events(), err)
	}
	defer sub.Unsubscribe()
	if err := c.nc.FlushTimeout(c.opts.Timeout); err != nil {
		return fmt.Errorf("subscribe to %s: %w", c.subjects.Events(), err)
	}
	fmt.Fprintf(c.stderr, "watching %s (Ctrl-C to stop)\n", c.subjects.Events())
	closed := make(chan struct{})
	c.nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	for n := 0; c.opts.Count == 0 || n < c.opts.Count; n++ {
		var m *nats.Msg
		select {
		case <-ctx.Done():
			return nil
		case <-closed:
			return fmt.Errorf("connection to NATS closed")
		case m = <-msgs:
		}
		if dropped, _ := sub.Dropped(); dropped > 0 {
			fmt.Fprintf(c.stderr, "shardctl: %d events lost: this watcher is too slow\n", dropped)
		}
		if c.opts.JSON {
			fmt.Fprintf(out, "%s\n", m.Data)
			continue
		}
		var ev protocol.Event
		if err := json.Unmarshal(m.Data, &ev); err != nil {
			fmt.Fprintf(out, "undecodable event: %q\n", m.Data)
			continue
		}
		fmt.Fprintln(out, describeEvent(ev))
	}
	return nil
}

// describeEvent is one line for people: local time, then what happened.
func describeEvent(ev protocol.Event) string {
	at := ev.Time
	if t, err := time.Parse(time.RFC3339Nano, ev.Time); err == nil {
		at = t.Local().Format("15:04:05.000")
	}
	shard := -1
	if ev.Shard != nil {
		shard = *ev.Shard
	}
	var what string
	switch ev.Kind {
	case protocol.EventCoordinator:
		what = fmt.Sprintf("coordinator %s leading (epoch %d)", ev.Region, ev.Epoch)
	case protocol.EventRegionUp:
		what = fmt.Sprintf("region %s registered", ev.Region)
	case protocol.EventLeaving:
		what = fmt.Sprintf("region %s leaving", ev.Region)
	case protocol.EventRegionGone:
		what = fmt.Sprintf("region %s gone", ev.Region)
	case protocol.EventPin:
		what = fmt.Sprintf("shard %d pinned to %s", shard, ev.Region)
	case protocol.EventUnpin:
		what = fmt.Sprintf("shard %d unpinned", shard)
	case protocol.EventShard:
		switch protocol.ShardState(ev.State) {
		case protocol.StateParked:
			what = fmt.Sprintf("shard %d parked: the coordinator buffers its messages", shard)
		case protocol.StateHandoff:
			what = fmt.Sprintf("shard %d handing off from %s", shard, ev.Source)
		case protocol.StateBinding:
			from := ev.Source
			if from == "" {
				from = "the coordinator"
			}
			what = fmt.Sprintf("shard %d binding on %s, replaying its buffer (from %s)", shard, ev.Region, from)
		case protocol.StateActive:
			what = fmt.Sprintf("shard %d active on %s", shard, ev.Region)
		default:
			what = fmt.Sprintf("shard %d %s on %s", shard, ev.State, orDash(ev.Region))
		}
	default:
		what = fmt.Sprintf("%s %+v", ev.Kind, ev)
	}
	return at + "  " + what
}
