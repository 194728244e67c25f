package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/natshardtest"
	"github.com/natshard/natshard/protocol"
)

// workerRuns is the shared place where a test daemon's workers record
// their runs: which region runs each index now, every start, and every
// moment two runs of one index overlapped.
type workerRuns struct {
	mu       sync.Mutex
	running  map[int][]string // index -> regions whose Run of it has not returned
	starts   map[int]int
	overlaps []string
	// slow: the regions whose workers take slowDown to return
	slow map[string]bool
}

func newWorkerRuns() *workerRuns {
	return &workerRuns{running: map[int][]string{}, starts: map[int]int{}}
}

// windDown is how long a test worker takes to return after its context
// ended: a handoff that started the next run before this one returned
// would be seen overlapping. The workers of a slow region take slowDown.
const (
	windDown = 100 * time.Millisecond
	slowDown = 2 * time.Second
)

// run is the daemon's Run: it records its start, runs until ctx ends,
// winds down, and records its end just before it returns.
func (r *workerRuns) run(ctx context.Context, index int) error {
	region := natshard.EnvFrom(ctx).Region
	r.mu.Lock()
	if others := r.running[index]; len(others) > 0 {
		r.overlaps = append(r.overlaps, fmt.Sprintf("worker %d started in %s while it ran in %v", index, region, others))
	}
	r.running[index] = append(r.running[index], region)
	r.starts[index]++
	pause := windDown
	if r.slow[region] {
		pause = slowDown
	}
	r.mu.Unlock()
	<-ctx.Done()
	time.Sleep(pause)
	r.mu.Lock()
	defer r.mu.Unlock()
	regions := r.running[index]
	r.running[index] = slices.Delete(regions, slices.Index(regions, region), slices.Index(regions, region)+1)
	return nil
}

// exactly reports whether each of the first n indexes runs in exactly one
// region, and no other index runs.
func (r *workerRuns) exactly(n int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, regions := range r.running {
		if want := i < n; len(regions) != 0 && !want || want && len(regions) != 1 {
			return false
		}
	}
	for i := range n {
		if len(r.running[i]) != 1 {
			return false
		}
	}
	return true
}

// where is how many workers each region runs now.
func (r *workerRuns) where() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]int{}
	for _, regions := range r.running {
		for _, reg := range regions {
			out[reg]++
		}
	}
	return out
}

func (r *workerRuns) startsOf(i int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.starts[i]
}

func (r *workerRuns) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for _, i := range slices.Sorted(maps.Keys(r.running)) {
		fmt.Fprintf(&b, "%d:%v ", i, r.running[i])
	}
	return b.String()
}

// check fails the test for every overlap seen.
func (r *workerRuns) check(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range r.overlaps {
		t.Error(o)
	}
}

// balanced reports whether the running workers are spread over the regions
// within one of even.
func balanced(where map[string]int, regions ...string) bool {
	lo, hi := -1, 0
	for _, reg := range regions {
		n := where[reg]
		if lo < 0 || n < lo {
			lo = n
		}
		hi = max(hi, n)
	}
	return hi-lo <= 1 && len(where) <= len(regions)
}

// TestDaemonWorkersOnce (issue 31 item 9): a daemon's workers run each
// exactly once, never two runs of one index at once, through a join (the
// workers spread to the new node), a move, a graceful leave, a crash (a
// node closed without handoff) and its restart, and a change of the count
// both ways; after each, every index below the count runs once and no
// other does.
func TestDaemonWorkersOnce(t *testing.T) {
	runs := newWorkerRuns()
	const workers = 6
	d := natshard.Daemon{Name: "workers", Workers: workers, Run: runs.run}
	typ := d.Type()
	typ.Shards = 16
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 2, Types: []natshard.Type{typ}})
	settled := func(what string, n int, regions ...string) {
		t.Helper()
		c.Eventually(what, func() bool {
			return runs.exactly(n) && (len(regions) == 0 || balanced(runs.where(), regions...))
		}, runs.String)
		runs.check(t)
	}
	r := natshardtest.Region
	settled("6 workers on 2 nodes", workers, r(0), r(1))

	c.Add() // node 2 joins: the strategy gives it workers
	settled("6 workers on 3 nodes after a join", workers, r(0), r(1), r(2))

	// Worker 0 (in shard 0) moved explicitly to another node.
	to := (c.Owner("workers", 0) + 1) % 3
	c.Move("workers", 0, to)
	settled("6 workers after a move", workers)
	if got := runs.where(); got[r(to)] == 0 {
		t.Errorf("worker 0 moved to node %d, which runs none: %v", to, got)
	}

	c.Stop(0) // leaves: its workers are handed off
	settled("6 workers on nodes 1 and 2 after a leave", workers, r(1), r(2))

	c.Crash(1) // closed without handoff
	settled("6 workers on node 2 after a crash", workers, r(2))
	c.Restart(1)
	settled("6 workers on nodes 1 and 2 after a restart", workers, r(1), r(2))

	ctx := t.Context()
	nc := c.Node(2).Conn()
	if err := natshard.ScaleDaemon(ctx, nc, "workers", 9); err != nil {
		t.Fatal(err)
	}
	settled("9 workers after growing", 9, r(1), r(2))
	if n, err := natshard.DaemonWorkers(ctx, nc, "workers"); err != nil || n != 9 {
		t.Fatalf("DaemonWorkers = %d, %v; want 9", n, err)
	}
	if err := natshard.ScaleDaemon(ctx, nc, "workers", 2); err != nil {
		t.Fatal(err)
	}
	settled("2 workers after shrinking", 2)

	// The workers taken out were forgotten: a full restart does not bring
	// them back.
	starts := map[int]int{}
	for i := 2; i < 9; i++ {
		starts[i] = runs.startsOf(i)
	}
	c.Crash(1)
	c.Crash(2)
	c.Restart(1)
	c.Restart(2)
	settled("2 workers after a full restart", 2, r(1), r(2))
	for i := 2; i < 9; i++ {
		if n := runs.startsOf(i); n != starts[i] {
			t.Errorf("worker %d, taken out, started again after a full restart (%d starts, %d before)", i, n, starts[i])
		}
	}
}

// TestDaemonReconnect: a node whose NATS connection drops stops its
// workers at once, and starts them again only once it has confirmed, back
// on NATS, that their shards are still its own (region.Agent.Serving).
func TestDaemonReconnect(t *testing.T) {
	runs := newWorkerRuns()
	d := natshard.Daemon{Name: "reconnect", Workers: 4, Run: runs.run}
	typ := d.Type()
	typ.Shards = 8
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 2, Types: []natshard.Type{typ}})
	c.Eventually("4 workers", func() bool { return runs.exactly(4) }, runs.String)
	mine := []int{}
	for i := range 4 {
		if c.Owner("reconnect", i) == 0 {
			mine = append(mine, i)
		}
	}
	if len(mine) == 0 {
		t.Fatalf("node 0 runs no worker: %v", runs)
	}
	before := map[int]int{}
	for _, i := range mine {
		before[i] = runs.startsOf(i)
	}
	if err := c.Node(0).Conn().ForceReconnect(); err != nil {
		t.Fatal(err)
	}
	c.Eventually("node 0's workers started again after its reconnect", func() bool {
		for _, i := range mine {
			if runs.startsOf(i) <= before[i] {
				return false
			}
		}
		return runs.exactly(4)
	}, runs.String)
	runs.check(t)
}

// TestDaemonCutOff: a node cut off from NATS (its connection closed, no
// reconnection for 10 s) whose workers take 2 s to return once their
// context ended: the coordinator re-homes its shards within a second, but
// their new owner starts the workers only once their claims' process has
// been gone from the registry for a lease TTL (4 s), after they returned,
// though the cut-off node could not release their claims. Without the
// claims, the new runs started while the old ones wound down.
func TestDaemonCutOff(t *testing.T) {
	runs := newWorkerRuns()
	runs.slow = map[string]bool{"cut": true}
	d := natshard.Daemon{Name: "cutoff", Workers: 4, Run: runs.run}
	typ := d.Type()
	typ.Shards = 8
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 1, Types: []natshard.Type{typ}})
	proxy := natstest.NewProxy(t, strings.TrimPrefix(c.URL(), "nats://"))
	ctx := t.Context()
	cut, err := natshard.Start(ctx, natshard.Options{NATS: proxy.URL(), Region: "cut", Logger: slog.New(slog.DiscardHandler)}, typ)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cut.Close(context.Background()) })
	c.Eventually("4 workers on node-0 and cut", func() bool {
		return runs.exactly(4) && balanced(runs.where(), natshardtest.Region(0), "cut")
	}, runs.String)

	proxy.Cut(10 * time.Second)
	c.Eventually("4 workers on node-0 while cut is cut off", func() bool {
		return runs.exactly(4) && runs.where()[natshardtest.Region(0)] == 4
	}, runs.String)
	runs.check(t)
	c.Eventually("4 workers once cut is back", func() bool { return runs.exactly(4) && balanced(runs.where(), natshardtest.Region(0), "cut") }, runs.String)
	runs.check(t)
}

// TestDaemonConfig: a daemon's misconfigurations are refused before
// anything starts, and ScaleDaemon refuses what is no daemon.
func TestDaemonConfig(t *testing.T) {
	ctx := t.Context()
	run := func(ctx context.Context, _ int) error { <-ctx.Done(); return nil }
	for _, tc := range []struct {
		name string
		typ  func() natshard.Type
		want string
	}{
		{"no run", func() natshard.Type { return natshard.Daemon{Name: "d", Workers: 1}.Type() }, "Daemon.Run: required"},
		{"negative", func() natshard.Type { return natshard.Daemon{Name: "d", Workers: -1, Run: run}.Type() }, "Daemon.Workers: -1 is out of range"},
		{"not remembered", func() natshard.Type {
			t := natshard.Daemon{Name: "d", Workers: 1, Run: run}.Type()
			t.Remember = false
			return t
		}, "Remember: a daemon's workers are remembered"},
	} {
		_, err := natshard.Start(ctx, natshard.Options{NATS: "nats://127.0.0.1:1"}, tc.typ())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Start: %v; want an error saying %q", tc.name, err, tc.want)
		}
	}

	plain := natshard.Type{Name: "plain", Entity: func(context.Context, string) (natshard.Entity, error) { return nil, errors.New("unused") }}
	c := natshardtest.Start(t, plain)
	nc, err := nats.Connect(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if err := natshard.ScaleDaemon(ctx, nc, "plain", 3); !errors.Is(err, natshard.ErrNotDaemon) {
		t.Errorf("ScaleDaemon of a plain type: %v; want ErrNotDaemon", err)
	}
	if _, err := natshard.DaemonWorkers(ctx, nc, "nothing"); !errors.Is(err, natshard.ErrNotDaemon) {
		t.Errorf("DaemonWorkers of no type: %v; want ErrNotDaemon", err)
	}
	if err := natshard.ScaleDaemon(ctx, nc, "plain", -1); err == nil {
		t.Error("ScaleDaemon to -1 workers: no error")
	}
	// A process that joins without a count needs one stored.
	_, err = natshard.Start(ctx, natshard.Options{NATS: c.URL(), Region: "late"}, natshard.Daemon{Name: "new", Run: run}.Type())
	if err == nil || !strings.Contains(err.Error(), "none is stored yet") {
		t.Errorf("a new daemon without Workers: %v; want an error", err)
	}
}

// TestWorkerIDs: worker i's entity lives in shard i % shards, and its id
// names the index back.
func TestWorkerIDs(t *testing.T) {
	for _, shards := range []int{1, 2, 7, 16, 128, 1000, 4096} {
		for i := range min(3*shards, 5000) {
			id := protocol.WorkerID(i, shards)
			if s := protocol.ShardOf(id, shards); s != i%shards {
				t.Fatalf("WorkerID(%d, %d) = %q in shard %d; want %d", i, shards, id, s, i%shards)
			}
			if got := protocol.WorkerIndex(id, shards); got != i {
				t.Fatalf("WorkerIndex(%q, %d) = %d; want %d", id, shards, got, i)
			}
			if err := protocol.ValidateEntityID(id); err != nil {
				t.Fatalf("WorkerID(%d, %d) = %q: %v", i, shards, id, err)
			}
		}
	}
	for _, id := range []string{"", "x", "-1", "01", "3-", "3-x", "65536"} {
		if got := protocol.WorkerIndex(id, 128); got != -1 {
			t.Errorf("WorkerIndex(%q) = %d; want -1", id, got)
		}
	}
	// A suffix that does not place the index in its shard is no worker's.
	for k := 1; ; k++ {
		id := fmt.Sprintf("5-%d", k)
		if protocol.ShardOf(id, 128) != 5 {
			if got := protocol.WorkerIndex(id, 128); got != -1 {
				t.Errorf("WorkerIndex(%q) = %d; want -1", id, got)
			}
			break
		}
	}
}

// TestReshardRefusesDaemon: a daemon's worker ids are made for its shard
// count, so a reshard of a daemon's type is refused, saying why, and the
// count stays.
func TestReshardRefusesDaemon(t *testing.T) {
	d := natshard.Daemon{Name: "fixed", Workers: 2, Run: func(ctx context.Context, _ int) error { <-ctx.Done(); return nil }}
	typ := d.Type()
	typ.Shards = 8
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 1, Types: []natshard.Type{typ}})
	c.Settle()
	_, err := natshard.Reshard(t.Context(), natstest.Connect(t, c.URL()), "fixed", 16)
	if !errors.Is(err, natshard.ErrBadRequest) || !strings.Contains(err.Error(), "daemon") {
		t.Fatalf("Reshard of a daemon's type: %v; want ErrBadRequest naming the daemon", err)
	}
	n, err := natshard.DaemonWorkers(t.Context(), natstest.Connect(t, c.URL()), "fixed")
	if err != nil || n != 2 {
		t.Fatalf("DaemonWorkers after the refusal = %d, %v", n, err)
	}
}
