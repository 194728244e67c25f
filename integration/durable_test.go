package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestDurableCrash (issue 13, docs/FAULTS.md, "Guarantees": durable delivery)
// runs three shardd of a kv type in durable delivery while a publisher appends
// numbered values to entities through the type's stream at about 3 000
// messages/s, half of the entities with a Nats-Msg-Id on every message and
// half without, and kills one region with -9 (embedded server, and a
// three-server cluster with R3), or, on the cluster, the NATS server a region
// is connected to. It proves: every value the stream acknowledged is applied
// once and in order (the entity's array is exactly the acknowledged values,
// ascending, plus at most once a value whose acknowledgement was lost), with
// or without Nats-Msg-Id; and it prints how long the shards took to be served
// again.
//
// The core subtest runs the same load and the same kill in core delivery
// (core NATS publishes), for the figures of both modes side by side: it
// reports what was lost (core delivery promises at most once) and proves
// only that nothing was applied twice or out of order.
func TestDurableCrash(t *testing.T) {
	embedded := func(t *testing.T, delivery string) {
		port := freePort(t)
		url := fmt.Sprintf("nats://127.0.0.1:%d", port)
		// a hosts the embedded server and is the only coordinator
		// candidate: it reads the server's disconnect advisories, so a
		// killed region is found at once (issue 17). b is killed, and
		// NATS lives on.
		testDurableCrash(t, url, nil, []string{"--listen", fmt.Sprintf("127.0.0.1:%d", port), "--data-dir", t.TempDir()}, []string{"--nats", url, "--no-coordinator"}, "region", delivery)
	}
	t.Run("embedded", func(t *testing.T) { embedded(t, "durable") })
	t.Run("core", func(t *testing.T) { embedded(t, "core") })
	t.Run("cluster", func(t *testing.T) {
		n := startNATS(t, "127.0.0.1")
		url := n.urls("127.0.0.1")
		args := []string{"--nats", url, "--replicas", "3"}
		testDurableCrash(t, url, n, noCoordinator(args), args, "region", "durable")
	})
	t.Run("server", func(t *testing.T) {
		n := startNATS(t, "127.0.0.1")
		url := n.urls("127.0.0.1")
		args := []string{"--nats", url, "--replicas", "3"}
		testDurableCrash(t, url, n, noCoordinator(args), args, "server", "durable")
	})
	// Issue 17: core delivery rides through the loss of a region's NATS
	// server: the region reconnects to another server within
	// milliseconds, holds what arrives, confirms its shards and goes on.
	// What is lost is what was published while the region had no
	// subscription anywhere (about 0.8 % here under the race detector),
	// nothing published after it confirmed its shards.
	t.Run("server-core", func(t *testing.T) {
		n := startNATS(t, "127.0.0.1")
		url := n.urls("127.0.0.1")
		args := []string{"--nats", url, "--replicas", "3"}
		testDurableCrash(t, url, n, noCoordinator(args), args, "server", "core")
	})
}

// firstParked reads the log of the coordinator p: when it parked its
// first message of each shard after since.
func firstParked(t *testing.T, p *proc, since time.Time) map[int]time.Time {
	t.Helper()
	parked := map[int]time.Time{}
	sc := bufio.NewScanner(strings.NewReader(p.log.String()))
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, `msg="parked a message"`) {
			continue
		}
		at, err := lineTime(line)
		_, rest, ok := strings.Cut(line, " shard=")
		shard, serr := strconv.Atoi(strings.Fields(rest + " ")[0])
		if err != nil || !ok || serr != nil {
			t.Fatalf("a line of %s's log: %q", p.name, line)
		}
		if _, seen := parked[shard]; !seen && at.After(since) {
			parked[shard] = at
		}
	}
	return parked
}

// noCoordinator is args of a region that never coordinates.
func noCoordinator(args []string) []string {
	return slices.Concat(args, []string{"--no-coordinator"})
}

func testDurableCrash(t *testing.T, url string, cluster *natsCluster, aArgs, args []string, kill, delivery string) {
	subjects := protocol.MustSubjects("", "", "kv")
	common := []string{"--type", "kv", "--kind", "kv", "--delivery", delivery, "--min-regions", "3", "--shards", "32"}
	start := func(name string, extra ...string) *proc {
		return startShardd(t, name, append(append([]string{"--region", name}, common...), extra...)...)
	}
	procs := map[string]*proc{"a": start("a", aArgs...)}
	nc := connect(t, url)
	procs["b"] = start("b", args...)
	procs["c"] = start("c", args...)
	st := waitSettled(t, nc, subjects, 90*time.Second, "a", "b", "c")
	// The victim is never a (on an embedded server, it is NATS) nor the
	// coordinator.
	victim := map[string]string{"a": "b", "b": "c", "c": "b"}[st.Coordinator.Region]
	if victim == "" {
		t.Fatalf("coordinator is %q, want a, b or c", st.Coordinator.Region)
	}

	load := startAppendLoad(t, url, subjects, st.Shards, 200, 3000, delivery == "core")
	time.Sleep(2 * time.Second)
	t0 := time.Now()
	switch kill {
	case "region":
		coordinator := st.Coordinator.Region
		procs[victim].kill()
		st = waitSettled(t, nc, subjects, 90*time.Second, without([]string{"a", "b", "c"}, victim)...)
		if delivery == "core" {
			// docs/FAULTS.md, "Guarantees": what was published to the dead
			// region's shards before they were parked is lost, nothing after.
			// (The share lost depends on how soon the coordinator parks them:
			// within milliseconds with the embedded server's disconnect
			// advisories, but under load, as in CI, up to half a second, 1.8 %
			// of the values; issue 17: 183 of about 17 000 by probes.)
			load.lossEnds = firstParked(t, procs[coordinator], t0)
		}
		t.Logf("%s kill -9 of region %s (%s): its shards served again after %s", delivery, victim, t.Name(), time.Since(t0).Round(time.Millisecond))
	case "server":
		server, err := cluster.serverOf("shardd " + victim)
		if err != nil {
			t.Fatal(err)
		}
		cluster.procs[server].kill()
		if delivery == "core" {
			// The region rides it through: it keeps its registration and
			// its shards (no fence), and confirms them once reconnected.
			// What was published to its shards while it had no
			// subscription anywhere is lost, nothing after it confirmed
			// its shards (it subscribed again before).
			confirmed := procs[victim].logTime(t, "shards confirmed after the reconnect")
			load.lossEnds = map[int]time.Time{}
			for shard := range st.Shards {
				load.lossEnds[shard] = confirmed
			}
			t.Logf("core kill -9 of NATS server %s (region %s's): the region confirmed its shards %s after the kill",
				cluster.name(server), victim, confirmed.Sub(t0).Round(time.Millisecond))
			if procs[victim].fenced() {
				t.Errorf("region %s fenced:\n%s", victim, procs[victim].log.String())
			}
			break
		}
		natstest.Eventually(t, 90*time.Second, "every shard active on a live region", func() error {
			st, err := status(nc, subjects)
			if err != nil {
				return err
			}
			for _, s := range st.Table {
				if s.State != "active" {
					return fmt.Errorf("shard %d is %s", s.Shard, s.State)
				}
			}
			return nil
		})
		t.Logf("durable kill -9 of NATS server %s (region %s's): every shard active again after %s", cluster.name(server), victim, time.Since(t0).Round(time.Millisecond))
	}
	time.Sleep(3 * time.Second)
	load.halt()
	if load.lossEnds != nil && kill == "region" {
		// A surviving region that fenced (it could not renew its
		// registration in time, under load) dropped what its entities'
		// mailboxes held: core delivery's at most once, a second fault,
		// whose losses the check cannot tell from the others.
		for name, p := range procs {
			if name != victim && p.fenced() {
				load.fenced = append(load.fenced, name)
			}
		}
	}
	load.check(t)
	if kill == "server" {
		assertSingleOwner(t, nc, subjects, st.Shards)
	}
}

// appendLoad appends numbered values to entities through the stream (or,
// in core delivery, with core NATS publishes).
type appendLoad struct {
	t        *testing.T
	core     bool
	nc       *nats.Conn
	js       jetstream.JetStream
	client   *natshard.Client
	subjects protocol.Subjects
	shards   int
	n        int
	stop     chan struct{}
	wg       sync.WaitGroup

	mu       sync.Mutex
	accepted [][]int       // per entity: the values the stream acknowledged (core: published), in order
	sentAt   [][]time.Time // per entity: when each accepted value's publish began
	unknown  [][]int       // per entity: values whose publish failed (may be stored)
	sent     atomic.Int64
	// lossEnds, when set (core delivery): when each shard stopped losing
	// what is published to it (a dead region's shards: when the
	// coordinator parked them; a region's whose server died: when it had
	// its subscriptions back); check fails when a value published after
	// that is lost.
	lossEnds map[int]time.Time
	// fenced: surviving regions that fenced; check then reports the
	// values lost after lossEnds without failing.
	fenced []string
}

// startAppendLoad publishes, per entity i, the values 0, 1, 2... in order
// (the next once the stream acknowledged the last), to n entities at
// about rate messages/s in all. Entities with an even number carry a
// Nats-Msg-Id (a failed publish is retried with it); the others carry
// none (a failed publish is given up and counted unknown).
func startAppendLoad(t *testing.T, url string, subjects protocol.Subjects, shards, n, rate int, core bool) *appendLoad {
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	l := &appendLoad{t: t, core: core, nc: nc, js: js, client: natshard.NewClient(nc), subjects: subjects, shards: shards, n: n, stop: make(chan struct{}),
		accepted: make([][]int, n), sentAt: make([][]time.Time, n), unknown: make([][]int, n)}
	const workers = 20
	every := time.Duration(workers) * time.Second / time.Duration(rate)
	for w := range workers {
		l.wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			next := make([]int, n)
			for round := 0; ; round++ {
				select {
				case <-l.stop:
					return
				case <-tick.C:
				}
				i := w + (round%(n/workers))*workers
				l.publish(i, next[i])
				next[i]++
			}
		})
	}
	return l
}

func (l *appendLoad) id(i int) string { return fmt.Sprintf("d-%d", i) }

// publish appends value v to entity i, retrying what is safe to retry.
func (l *appendLoad) publish(i, v int) {
	m := nats.NewMsg(l.subjects.EntityOf(l.id(i), l.shards))
	m.Data = fmt.Appendf(nil, `{"op":"append","key":"v","value":%d}`, v)
	withID := i%2 == 0
	if withID {
		m.Header.Set(protocol.HeaderMsgID, fmt.Sprintf("%d-%d", i, v))
	}
	for try := 0; ; try++ {
		var err error
		at := time.Now()
		if l.core {
			err = l.nc.PublishMsg(m)
		} else {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err = l.js.PublishMsg(ctx, m)
			cancel()
		}
		l.sent.Add(1)
		if err == nil {
			l.mu.Lock()
			l.accepted[i] = append(l.accepted[i], v)
			l.sentAt[i] = append(l.sentAt[i], at)
			l.mu.Unlock()
			return
		}
		if !withID || try == 20 {
			l.mu.Lock()
			l.unknown[i] = append(l.unknown[i], v)
			l.mu.Unlock()
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (l *appendLoad) halt() {
	close(l.stop)
	l.wg.Wait()
}

// check reads every entity (requests through the stream, answered once
// everything before them was handled) and compares.
func (l *appendLoad) check(t *testing.T) {
	t.Helper()
	var accepted, unknown, doubled, doubledNoID, lost, lostAfter, storedUnknown int
	lostBy := map[int]int{} // shard -> values lost
	for i := range l.n {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		data, err := l.client.Request(ctx, "kv", l.id(i), []byte(`{"op":"get","key":"v"}`))
		cancel()
		if err != nil {
			t.Fatalf("entity %s: %v", l.id(i), err)
		}
		var ans struct {
			Value []int `json:"value"`
		}
		if err := json.Unmarshal(data, &ans); err != nil {
			t.Fatalf("entity %s: %s: %v", l.id(i), data, err)
		}
		got, acc, unk := ans.Value, l.accepted[i], l.unknown[i]
		accepted += len(acc)
		unknown += len(unk)
		// Ascending, each value once: acknowledged ones all there, unknown
		// ones at most once. Core delivery applies a message without
		// Nats-Msg-Id twice where a parked shard's diversion and its new
		// owner's subscription overlap (docs/FAULTS.md, "Guarantees": at least
		// once without an id, in per-publisher order): there, a copy may come
		// again after later values (the parking and the owner can see
		// different publishers' messages in different orders, and the replay
		// places held arrivals by the keyed ones), so only first applications
		// must ascend, as in TestLoadWithMoves.
		maybeTwice := l.core && i%2 == 1
		seen := map[int]bool{}
		last, ordered := -1, true // last: the highest value applied so far
		for j, v := range got {
			if seen[v] {
				if maybeTwice {
					doubledNoID++
					continue
				}
				doubled++
			}
			seen[v] = true
			// Reported once; the values after are still counted as seen
			// (a break here counted them all lost: a CI run's 1 846
			// "lost after the loss window" were applied, out of order).
			if ordered && v < last {
				t.Errorf("entity %s: applied out of order at %d (%d after %d): %v", l.id(i), j, v, last, got)
				ordered = false
			}
			last = max(last, v)
		}
		shard := protocol.ShardOf(l.id(i), l.shards)
		for j, v := range acc {
			if !seen[v] {
				lost++
				lostBy[shard]++
				if lost < 5 && !l.core {
					t.Errorf("entity %s: acknowledged value %d lost: %v", l.id(i), v, got)
				}
				// Log times have milliseconds: a value sent in the
				// millisecond of the first parked message may be lost.
				if end, ok := l.lossEnds[shard]; ok && l.sentAt[i][j].After(end.Add(time.Millisecond)) {
					lostAfter++
					if lostAfter < 5 && len(l.fenced) == 0 {
						t.Errorf("entity %s: value %d, published %s after shard %d's loss window ended (parked, or its region's subscriptions back), lost", l.id(i), v, l.sentAt[i][j].Sub(end), shard)
					}
				}
			}
		}
		for _, v := range unk {
			if seen[v] {
				storedUnknown++
			}
		}
		if extra := len(seen) - len(acc) - len(unk); extra > 0 {
			t.Errorf("entity %s holds %d values never sent: %v", l.id(i), extra, got)
		}
	}
	if l.core {
		t.Logf("core load: %d values published, lost %d (%.2f%%), applied twice %d with Nats-Msg-Id and %d without",
			l.sent.Load(), lost, 100*float64(lost)/float64(max(accepted, 1)), doubled, doubledNoID)
		if lost > 0 {
			t.Logf("lost by shard: %v", lostBy)
		}
		if l.lossEnds != nil {
			t.Logf("lost though published after their shard's loss window: %d (of %d shards)", lostAfter, len(l.lossEnds))
			if lostAfter > 0 && len(l.fenced) > 0 {
				t.Logf("not a failure: regions %v fenced meanwhile, dropping what their mailboxes held (core delivery is at most once)", l.fenced)
			}
		}
		if doubled > 0 {
			t.Fatalf("%d values with a Nats-Msg-Id applied twice", doubled)
		}
		return
	}
	t.Logf("durable load: %d publishes, %d values acknowledged by the stream, %d not (%d of those stored all the same); lost %d, applied twice %d",
		l.sent.Load(), accepted, unknown, storedUnknown, lost, doubled)
	if lost > 0 || doubled > 0 {
		t.Fatalf("%d acknowledged values lost, %d applied twice", lost, doubled)
	}
	if accepted == 0 {
		t.Fatal("no value acknowledged")
	}
}
