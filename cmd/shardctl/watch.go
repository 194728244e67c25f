package main

import (
	"bytes"
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
		case <-c.denials.seen:
			return c.denied()
		case m = <-msgs:
		}
		if dropped, _ := sub.Dropped(); dropped > 0 {
			fmt.Fprintf(c.stderr, "shardctl: %d events lost: this watcher is too slow\n", dropped)
		}
		var ev protocol.Event
		err := json.Unmarshal(m.Data, &ev)
		switch {
		case c.opts.JSON:
			err = printEventJSON(out, m.Data)
		case err != nil:
			_, err = fmt.Fprintf(out, "undecodable event: %s\n", clean(string(m.Data)))
		default:
			_, err = fmt.Fprintln(out, describeEvent(ev))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// printEventJSON prints an event as one line of JSON: as the coordinator
// sent it (unknown fields kept) when it is JSON, compacted (so that no
// carriage return or other white space between its tokens reaches the
// terminal) and made safe (jsonSafe); else as {"undecodable_event": ...}.
func printEventJSON(out io.Writer, data []byte) error {
	var buf bytes.Buffer
	if err := json.Compact(&buf, data); err != nil {
		buf.Reset()
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(map[string]string{"undecodable_event": string(data)}); err != nil {
			return err
		}
		buf.Truncate(buf.Len() - 1)
	}
	buf.WriteByte('\n')
	_, err := out.Write(jsonSafe(buf.Bytes()))
	return err
}

// describeEvent is one line for people: local time, then what happened.
func describeEvent(ev protocol.Event) string {
	at := ev.Time
	if t, err := time.Parse(time.RFC3339Nano, ev.Time); err == nil {
		at = clock(t)
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
	case protocol.EventUndrained:
		what = fmt.Sprintf("region %s takes shards again (undrained)", ev.Region)
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
	// Every field came from the network (anyone who may publish on the
	// events subject can forge an event).
	return clean(at + "  " + what)
}
