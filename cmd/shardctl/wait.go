package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// --wait follows a change the coordinator accepted until it is done: it
// reads the shard table (the coordinator's status, or KV during a
// failover) every 250 ms and whenever an event about the change arrives,
// and prints progress on stderr: the events (as shardctl watch does) and
// what is left each time it changes. stdout keeps the command's result,
// and with --json only JSON. --timeout bounds the whole command; a timeout
// says what it waited for and what is still not done. Events only make
// the progress visible sooner: the table decides, so lost events cost
// nothing.

// goal is what a command waits for.
type goal struct {
	what string // "shard 17 to be active on b"
	// relevant says whether an event is about the change (printed).
	relevant func(ev protocol.Event) bool
	// check reads the table: done is the line to print when the goal is
	// reached ("" while not), left says what is not done yet, err that it
	// ended otherwise.
	check func(v view) (done, left string, err error)
	// stuck, if set, explains a timeout from the last table read.
	stuck func() string
}

// waiter follows a change for --wait. It subscribes to the events before
// the change is asked for, so that it sees all of them.
type waiter struct {
	c      *client
	sub    *nats.Subscription
	events chan *nats.Msg
}

// startWait subscribes to the events if --wait was given; nil otherwise.
func (c *client) startWait() (*waiter, error) {
	if !c.opts.Wait {
		return nil, nil
	}
	w := &waiter{c: c, events: make(chan *nats.Msg, 4096)}
	sub, err := c.nc.ChanSubscribe(c.subjects.Events(), w.events)
	if err == nil {
		err = c.nc.FlushTimeout(c.opts.Timeout)
	}
	if err != nil {
		return nil, c.noAnswer(err, "the server to a subscription", c.subjects.Events())
	}
	w.sub = sub
	return w, nil
}

func (w *waiter) stop() {
	if w != nil {
		_ = w.sub.Unsubscribe()
	}
}

// until waits for g, printing progress, until ctx ends.
func (w *waiter) until(ctx context.Context, g *goal) (string, error) {
	c := w.c
	say(c.stderr, "waiting for %s (at most %v; Ctrl-C stops the waiting, not the change)\n", g.what, c.opts.Timeout)
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var left string
	var readErr error
	for check := true; ; {
		if check {
			v, err := c.view(ctx)
			switch {
			case err == nil:
				done, l, err := g.check(v)
				if err != nil || done != "" {
					w.printQueued(g)
					return done, err
				}
				if l != left {
					say(c.stderr, "%s  %s\n", clock(time.Now()), l)
					left = l
				}
			case c.denied() != nil:
				return "", c.denied()
			case ctx.Err() == nil:
				readErr = err
			}
		}
		select {
		case <-ctx.Done():
			if left == "" && readErr != nil {
				left = fmt.Sprintf("the table could not be read: %v", readErr)
			}
			if g.stuck != nil {
				left += g.stuck()
			}
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return "", fmt.Errorf("timed out after %v (--timeout) waiting for %s: %s", c.opts.Timeout, g.what, left)
			}
			return "", fmt.Errorf("stopped waiting for %s (the change goes on): %s", g.what, left)
		case m := <-w.events:
			var ev protocol.Event
			check = json.Unmarshal(m.Data, &ev) == nil && g.relevant(ev)
			if check {
				fmt.Fprintln(c.stderr, describeEvent(ev))
			}
		case <-tick.C:
			check = true
		}
	}
}

// printQueued prints the relevant events that arrived before the table
// said the goal was reached (the last steps, usually).
func (w *waiter) printQueued(g *goal) {
	for {
		select {
		case m := <-w.events:
			var ev protocol.Event
			if json.Unmarshal(m.Data, &ev) == nil && g.relevant(ev) {
				fmt.Fprintln(w.c.stderr, describeEvent(ev))
			}
		default:
			return
		}
	}
}

// clock is a time as watch and --wait print it.
func clock(t time.Time) string { return t.Local().Format("15:04:05.000") }

func shardEvent(ev protocol.Event, shard int) bool {
	return ev.Kind == protocol.EventShard && ev.Shard != nil && *ev.Shard == shard
}

// where says where a row of the table is, for progress lines.
func where(r protocol.ShardView) string {
	switch r.State {
	case string(protocol.StateActive):
		return "active on " + r.Region
	case string(protocol.StateHandoff):
		return "handing off from " + r.Source
	case string(protocol.StateBinding):
		from := r.Source
		if from == "" {
			from = "the coordinator"
		}
		return fmt.Sprintf("binding on %s (from %s)", r.Region, from)
	}
	return r.State
}

func row(v view, shard int) protocol.ShardView {
	if shard < len(v.Table) {
		return v.Table[shard]
	}
	return protocol.ShardView{Shard: shard, State: string(protocol.StateUnowned)}
}

func findRegion(v view, id string) (protocol.RegionView, bool) {
	i := slices.IndexFunc(v.Regions, func(r protocol.RegionView) bool { return r.ID == id })
	if i < 0 {
		return protocol.RegionView{}, false
	}
	return v.Regions[i], true
}

// listShards is at most 8 shard numbers, with how many more there are.
func listShards(shards []int) string {
	const most = 8
	parts := make([]string, 0, most+1)
	for i, sh := range shards {
		if i == most {
			parts = append(parts, fmt.Sprintf("and %d more", len(shards)-most))
			break
		}
		parts = append(parts, fmt.Sprint(sh))
	}
	return strings.Join(parts, ", ")
}

// moveGoal: the shard is active on the region. A move that ends elsewhere
// (the region left, or could not take it) is an error.
func moveGoal(shard int, region string) *goal {
	return &goal{
		what:     fmt.Sprintf("shard %d to be active on %s", shard, region),
		relevant: func(ev protocol.Event) bool { return shardEvent(ev, shard) },
		check: func(v view) (string, string, error) {
			r := row(v, shard)
			switch {
			case r.State != string(protocol.StateActive):
				return "", fmt.Sprintf("shard %d is %s", shard, where(r)), nil
			case r.Region != region:
				return "", "", fmt.Errorf("shard %d ended on %s, not %s: the coordinator placed it again (is %s still registered and not leaving? shardctl regions)", shard, r.Region, region, region)
			}
			return fmt.Sprintf("shard %d is active on %s", shard, region), "", nil
		},
	}
}

// drainGoal: no shard of the table is on the region, as owner or as the
// source of a move.
func drainGoal(region string) *goal {
	seen := map[int]bool{} // shards that were on the region
	notLeaving := false    // in the last table read
	return &goal{
		stuck: func() string {
			if notLeaving {
				return fmt.Sprintf("; %s is not marked leaving: it did not get the drain, or was undrained (shardctl regions; drain it again)", region)
			}
			return ""
		},
		what: fmt.Sprintf("region %s to hand off all of its shards", region),
		relevant: func(ev protocol.Event) bool {
			if ev.Kind != protocol.EventShard {
				return ev.Region == region
			}
			return ev.Shard != nil && (ev.Region == region || ev.Source == region || seen[*ev.Shard])
		},
		check: func(v view) (string, string, error) {
			var held []int
			for _, r := range v.Table {
				if r.Region == region || r.Source == region {
					held = append(held, r.Shard)
					seen[r.Shard] = true
				}
			}
			reg, registered := findRegion(v, region)
			notLeaving = registered && !reg.Leaving
			switch {
			case len(held) == 0 && !registered:
				return fmt.Sprintf("region %s holds no shard (it is no longer registered)", region), "", nil
			case len(held) == 0:
				return fmt.Sprintf("region %s holds no shard", region), "", nil
			}
			left := fmt.Sprintf("%d shards still on %s: %s", len(held), region, listShards(held))
			if len(held) == 1 {
				left = fmt.Sprintf("1 shard still on %s: %d", region, held[0])
			}
			return "", left, nil
		},
	}
}

// undrainGoal: the region's registration no longer says leaving.
func undrainGoal(region string) *goal {
	return &goal{
		what:     fmt.Sprintf("region %s to take shards again", region),
		relevant: func(ev protocol.Event) bool { return ev.Kind != protocol.EventShard && ev.Region == region },
		check: func(v view) (string, string, error) {
			reg, ok := findRegion(v, region)
			switch {
			case !ok:
				return "", "", fmt.Errorf("region %s is no longer registered", region)
			case reg.Leaving:
				return "", fmt.Sprintf("region %s is still marked leaving (if this lasts, it refused: see its log)", region), nil
			}
			return fmt.Sprintf("region %s takes shards again", region), "", nil
		},
	}
}

// rebalanceGoal: every shard the round moved is active again.
func rebalanceGoal(moves []protocol.PlannedMove) *goal {
	moved := make([]int, len(moves))
	for i, m := range moves {
		moved[i] = m.Shard
	}
	what := fmt.Sprintf("the %d moves of the round", len(moves))
	if len(moves) == 1 {
		what = "the move of the round"
	}
	return &goal{
		what: what,
		relevant: func(ev protocol.Event) bool {
			return ev.Kind == protocol.EventShard && ev.Shard != nil && slices.Contains(moved, *ev.Shard)
		},
		check: func(v view) (string, string, error) {
			var placed []string
			var notYet []int
			for _, sh := range moved {
				r := row(v, sh)
				if r.State == string(protocol.StateActive) {
					placed = append(placed, fmt.Sprintf("%d on %s", sh, r.Region))
				} else {
					notYet = append(notYet, sh)
				}
			}
			if len(notYet) == 0 {
				return "every moved shard is active: " + strings.Join(placed, ", "), "", nil
			}
			return "", fmt.Sprintf("%d of %d moved shards active; not yet: %s", len(moved)-len(notYet), len(moved), listShards(notYet)), nil
		},
	}
}
