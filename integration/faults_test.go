package integration

// Fault scenarios on the deployment users run (issue 5, docs/FAULTS.md): a
// three-server NATS cluster with the KV bucket and the buffer stream
// replicated three times, and shardd processes connected to all three
// servers. Network partitions put a shardd on a separate host (a network
// namespace) and cut its link. Each test asserts the invariants and logs
// the times it measured; docs/FAULTS.md has the table.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// deployment is a NATS cluster and the shardd processes on it.
type deployment struct {
	t        *testing.T
	nats     *natsCluster
	nc       *nats.Conn
	subjects protocol.Subjects
	events   *events
	procs    map[string]*proc
	common   []string
}

// newDeployment starts the NATS cluster (clients listening on listen);
// every shardd gets args.
func newDeployment(t *testing.T, listen string, args ...string) *deployment {
	t.Helper()
	n := startNATS(t, listen)
	d := &deployment{
		t: t, nats: n, nc: connect(t, n.urls("127.0.0.1")),
		subjects: protocol.MustSubjects("", "", "kv"),
		procs:    map[string]*proc{},
		common:   append([]string{"--type", "kv", "--kind", "kv", "--replicas", "3"}, args...),
	}
	d.events = watchEvents(t, d.nc, d.subjects)
	return d
}

// start starts region name on this machine.
func (d *deployment) start(name string, args ...string) { d.startOn(nil, name, args...) }

// startOn starts region name on host h (this machine when nil).
func (d *deployment) startOn(h *netHost, name string, args ...string) {
	d.t.Helper()
	url := d.nats.urls("127.0.0.1")
	if h != nil {
		url = d.nats.urls(h.gateway)
	}
	all := append(append([]string{"--region", name, "--nats", url}, d.common...), args...)
	d.procs[name] = startProcessOn(d.t, h, "shardd", name, all...)
}

func (d *deployment) settled(timeout time.Duration, live ...string) protocol.Status {
	d.t.Helper()
	return waitSettled(d.t, d.nc, d.subjects, timeout, live...)
}

// serving waits until the table is settled on the live regions, stays so
// for longer than a rebalance interval (a region that registered again
// empty is given shards by the next round), and every shard answers, once:
// after a fault the table may still name a region that no longer serves.
func (d *deployment) serving(timeout time.Duration, live ...string) protocol.Status {
	d.t.Helper()
	var st protocol.Status
	natstest.Eventually(d.t, timeout, fmt.Sprintf("every shard active, unchanged and served on %v", live), func() error {
		first, err := status(d.nc, d.subjects)
		if err != nil {
			return err
		}
		if err := settled(first, live...); err != nil {
			return err
		}
		time.Sleep(3 * time.Second)
		if st, err = status(d.nc, d.subjects); err != nil {
			return err
		}
		if err := settled(st, live...); err != nil {
			return err
		}
		if !maps.Equal(owners(first), owners(st)) {
			return errors.New("the table changed meanwhile")
		}
		return singleOwner(d.nc, d.subjects, st.Shards)
	})
	return st
}

// coordinator waits for a coordinator other than not, of an epoch above
// after, and returns the status it answered.
func (d *deployment) coordinator(timeout time.Duration, not string, after uint64) protocol.Status {
	d.t.Helper()
	var st protocol.Status
	natstest.Eventually(d.t, timeout, "a new coordinator", func() error {
		var err error
		if st, err = status(d.nc, d.subjects); err != nil {
			return err
		}
		if st.Coordinator.Region == not || st.Coordinator.Epoch <= after {
			return fmt.Errorf("coordinator %s epoch %d", st.Coordinator.Region, st.Coordinator.Epoch)
		}
		return nil
	})
	return st
}

// TestNATSServerLoss kills (-9) the NATS server the coordinator is
// connected to, then the one a region is connected to. Clients reconnect
// to the other servers; a region whose connection broke suspends its
// shards (its subscriptions were on the lost server, and nats.go restores
// them on reconnect), then renews its registration and confirms them
// (region.Agent.Suspend); the bucket and the stream elect new leaders. Afterwards every shard has one owner, every acknowledged write
// is there, and no request was handled twice.
func TestNATSServerLoss(t *testing.T) {
	d := newDeployment(t, "127.0.0.1", "--min-regions", "3")
	for _, r := range []string{"a", "b", "c"} {
		d.start(r)
	}
	st := d.settled(60*time.Second, "a", "b", "c")
	seedEntities(t, d.nc, d.subjects, st.Shards)
	load := startIncrLoad(t, d.nats.urls("127.0.0.1"), d.subjects, st.Shards, 300, 6)

	for _, whose := range []string{"coordinator", "region"} {
		target := st.Coordinator.Region
		server, err := d.nats.serverOf("shardd " + target)
		if err != nil {
			t.Fatal(err)
		}
		if whose == "region" {
			target, server = d.regionAwayFrom(st.Coordinator.Region, server)
		}
		leaders := streamLeaders(t, d.nc)
		t0 := time.Now()
		d.nats.procs[server].kill()
		natstest.Eventually(t, 90*time.Second, "every shard served", func() error { return singleOwner(d.nc, d.subjects, st.Shards) })
		served := time.Since(t0)
		st = d.serving(90*time.Second, "a", "b", "c")
		t.Logf("kill -9 of NATS server %s (the %s %s's; stream leaders were %s): every shard served again after %s, settled on a, b and c and unchanged for 3 s after %s; coordinator %s epoch %d",
			d.nats.name(server), whose, target, leaders, served.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond), st.Coordinator.Region, st.Coordinator.Epoch)
		assertSingleOwner(t, d.nc, d.subjects, st.Shards)
		assertEntities(t, d.nc, d.subjects, st.Shards)

		d.nats.start(server)
		d.nats.waitHealthy(90 * time.Second)
	}
	load.halt()
	load.check(t, false)
}

// regionAwayFrom picks a region other than coord, on another server than
// coordServer when one is: killing that server then hits a region and not
// the coordinator.
func (d *deployment) regionAwayFrom(coord string, coordServer int) (region string, server int) {
	d.t.Helper()
	for _, r := range []string{"a", "b", "c"} {
		i, err := d.nats.serverOf("shardd " + r)
		if err != nil || r == coord {
			continue
		}
		if region == "" || i != coordServer {
			region, server = r, i
		}
	}
	if region == "" {
		d.t.Fatal("no region other than the coordinator's is connected")
	}
	return region, server
}

// TestRegionPartition cuts the network of a region's host (its process
// keeps running). The region fences itself before its registration can
// expire on the server; its shards move; requests to them are answered by
// their new owners. When the network heals it holds none of the shards it
// lost (nats.go's resubscription on reconnect does not bring them back), it
// registers again and can be given shards.
func TestRegionPartition(t *testing.T) {
	h := newNetHost(t)
	// A short lease (not the cluster's default 15 s): the region must fence
	// at 3/4 of it even though a renewal into a cut network would wait
	// longer (the store's 5 s timeout).
	d := newDeployment(t, "0.0.0.0", "--min-regions", "3", "--rebalance-interval", "0", "--lease-ttl", "4s")
	d.start("a")
	d.start("b")
	d.startOn(h, "c", "--no-coordinator")
	st := d.settled(60*time.Second, "a", "b", "c")
	seedEntities(t, d.nc, d.subjects, st.Shards)
	load := startIncrLoad(t, d.nats.urls("127.0.0.1"), d.subjects, st.Shards, 300, 6)
	before := owners(st)
	time.Sleep(time.Second) // requests in flight when the network goes

	t0 := time.Now()
	h.cut()
	st = d.settled(60*time.Second, "a", "b")
	rehomed := time.Since(t0)
	assertKept(t, before, owners(st), "c")
	// c must have stopped serving before the coordinator could act on the
	// expiry of its registration: before the first change to its shards.
	fenced := d.procs["c"].logTime(t, fencedLine)
	changed, ok := d.events.first(t0, func(ev protocol.Event) bool {
		return ev.Kind == protocol.EventShard && ev.Shard != nil && before[*ev.Shard] == "c"
	})
	if !ok {
		t.Fatal("no event of a change to a shard of c")
	}
	if !fenced.Before(changed.at) {
		t.Fatalf("c fenced at %s, after its shard %d became %s at %s", fenced.Format(time.StampMilli), *changed.Shard, changed.State, changed.at.Format(time.StampMilli))
	}
	gone, _ := d.events.first(t0, func(ev protocol.Event) bool { return ev.Kind == protocol.EventRegionGone && ev.Region == "c" })
	t.Logf("partition of region c (%d shards): fenced after %s, found gone after %s, first shard %s after %s, all re-homed after %s",
		countOwned(before, "c"), fenced.Sub(t0).Round(time.Millisecond), gone.at.Sub(t0).Round(time.Millisecond),
		changed.State, changed.at.Sub(t0).Round(time.Millisecond), rehomed.Round(time.Millisecond))
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)
	assertEntities(t, d.nc, d.subjects, st.Shards)

	t1 := time.Now()
	h.heal()
	// c registers again, holding nothing: with no strategy rounds, nothing
	// gives it a shard until the rebalance below.
	st = d.settled(60*time.Second, "a", "b", "c")
	t.Logf("after the heal, c registered again in %s", time.Since(t1).Round(time.Millisecond))
	if held := queryHeld(t, d.nc, d.subjects, "c"); len(held) != 0 {
		t.Fatalf("c serves shards %v after the heal, none of them given to it", held)
	}
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)

	// An operator's rebalance gives it shards. A round may find it
	// between registrations (a registration sent into the cut network is
	// written again after the heal), and its moves end elsewhere: ask
	// again until it owns shards.
	natstest.Eventually(t, 60*time.Second, "c given shards by a rebalance", func() error {
		st, err := status(d.nc, d.subjects)
		if err != nil {
			return err
		}
		if err := settled(st, "a", "b", "c"); err != nil {
			return err
		}
		if n := countOwned(owners(st), "c"); n > 0 {
			return nil
		}
		var plan protocol.RebalanceAnswer
		if err := adminRequest(d.nc, d.subjects, protocol.AdminRebalance, protocol.RebalanceRequest{}, &plan); err != nil {
			return err
		}
		t.Logf("rebalance: %d moves (%d shards in progress)", len(plan.Moves), plan.InProgress)
		time.Sleep(time.Second)
		return errors.New("c owns no shard")
	})
	st = d.settled(60*time.Second, "a", "b", "c")
	load.halt()
	load.check(t, false)
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)
	assertEntities(t, d.nc, d.subjects, st.Shards)
}

// TestCoordinatorPartition cuts the network of the coordinator's host.
// Another candidate takes the lease; no shard of a live region moves; no
// shard row written after the new term began carries the old term's
// epoch (the server refuses the deposed coordinator's writes: they are
// fenced on the lease's revision); when the network heals there is one
// coordinator, and the old one is a region again.
func TestCoordinatorPartition(t *testing.T) {
	h := newNetHost(t)
	// A short lease, as in TestRegionPartition: the coordinator must step
	// down at 3/4 of it, before the server lets another take it.
	d := newDeployment(t, "0.0.0.0", "--min-regions", "3", "--rebalance-interval", "0", "--lease-ttl", "4s")
	d.startOn(h, "c")
	natstest.Eventually(t, 60*time.Second, "c coordinating", func() error {
		st, err := status(d.nc, d.subjects)
		if err == nil && st.Coordinator.Region != "c" {
			err = fmt.Errorf("coordinator is %s", st.Coordinator.Region)
		}
		return err
	})
	d.start("a")
	d.start("b")
	st := d.settled(60*time.Second, "a", "b", "c")
	seedEntities(t, d.nc, d.subjects, st.Shards)
	before, oldEpoch := owners(st), st.Coordinator.Epoch

	t0 := time.Now()
	h.cut()
	st = d.coordinator(60*time.Second, "c", oldEpoch)
	failover := time.Since(t0)
	newEpoch := st.Coordinator.Epoch
	st = d.settled(60*time.Second, "a", "b")
	t.Logf("partition of the coordinator c: %s took the lease (epoch %d -> %d) after %s; c's %d shards re-homed after %s",
		st.Coordinator.Region, oldEpoch, newEpoch, failover.Round(time.Millisecond), countOwned(before, "c"), time.Since(t0).Round(time.Millisecond))
	assertKept(t, before, owners(st), "c")
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)
	assertEntities(t, d.nc, d.subjects, st.Shards)

	// c gave up the lease before another could take it.
	stepped := d.procs["c"].logTime(t, "lost or gave up the coordinator lease")
	took, ok := d.events.first(t0, func(ev protocol.Event) bool { return ev.Kind == protocol.EventCoordinator && ev.Region != "c" })
	if !ok {
		t.Fatal("no event of a new coordinator")
	}
	if !stepped.Before(took.at) {
		t.Fatalf("c stepped down at %s, after %s took the lease at %s", stepped.Format(time.StampMilli), took.Region, took.at.Format(time.StampMilli))
	}
	t.Logf("c stepped down after %s, %s took the lease after %s", stepped.Sub(t0).Round(time.Millisecond), took.Region, took.at.Sub(t0).Round(time.Millisecond))

	t1 := time.Now()
	h.heal()
	st = d.settled(60*time.Second, "a", "b", "c")
	t.Logf("after the heal, c registered again in %s", time.Since(t1).Round(time.Millisecond))
	if n := countReplies(t, d.nc, d.subjects.Admin(protocol.AdminStatus), []byte("{}")); n != 1 {
		t.Fatalf("%d coordinators answered the status request, want 1", n)
	}
	assertRowsOfTerm(t, d.nc, newEpoch)
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)
	assertEntities(t, d.nc, d.subjects, st.Shards)
}

// TestTwoRegionsLeave stops two of four regions at once, one of them the
// coordinator's, under load. Their shards move (planned moves: every
// request is answered, none twice); the shards of the two that stay do
// not move.
func TestTwoRegionsLeave(t *testing.T) {
	d := newDeployment(t, "127.0.0.1", "--min-regions", "4", "--rebalance-interval", "0")
	all := []string{"a", "b", "c", "d"}
	for _, r := range all {
		d.start(r)
	}
	st := d.settled(60*time.Second, all...)
	load := startIncrLoad(t, d.nats.urls("127.0.0.1"), d.subjects, st.Shards, 300, 6)
	time.Sleep(time.Second)

	coord := st.Coordinator.Region
	other := map[string]string{"a": "b"}[coord]
	if other == "" {
		other = "a"
	}
	var stay []string
	for _, r := range all {
		if r != coord && r != other {
			stay = append(stay, r)
		}
	}
	before := owners(st)
	t0 := time.Now()
	var wg sync.WaitGroup
	for _, r := range []string{coord, other} {
		wg.Go(func() {
			if err := d.procs[r].stop(60 * time.Second); err != nil {
				t.Errorf("graceful stop of %s: %v", r, err)
			}
		})
	}
	wg.Wait()
	stopped := time.Since(t0)
	st = d.settled(60*time.Second, stay...)
	t.Logf("regions %s (coordinator, %d shards) and %s (%d shards) left at once: both exited after %s, all settled on %v after %s",
		coord, countOwned(before, coord), other, countOwned(before, other), stopped.Round(time.Millisecond), stay, time.Since(t0).Round(time.Millisecond))
	assertKept(t, before, owners(st), coord, other)
	load.halt()
	load.check(t, true)
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)
	for _, r := range all {
		assertFewInfoLines(t, r, d.procs[r].log.String(), 50)
	}
}

// assertFewInfoLines fails the test when a process's log has more than
// max INFO lines: INFO is for what an operator acts on (membership,
// coordinator terms, a line per rebalance round), not for each shard's
// steps of a move (docs/OPERATIONS.md, "Logs"). Before they went to DEBUG
// one process of three logged 1 433 INFO lines in 25 s of moves; here a
// process logs 5 to 20 while four regions take 128 shards and two leave.
func assertFewInfoLines(t *testing.T, name, log string, max int) {
	t.Helper()
	count := map[string]int{}
	n := 0
	for line := range strings.Lines(log) {
		if !strings.Contains(line, " level=INFO ") {
			continue
		}
		n++
		msg := line
		if i := strings.Index(line, " msg="); i >= 0 {
			msg = line[i+len(" msg="):]
			if j := strings.Index(msg, " type="); j >= 0 {
				msg = msg[:j]
			}
		}
		count[strings.TrimSpace(msg)]++
	}
	if n > max {
		t.Errorf("shardd %s logged %d INFO lines, more than %d (per-shard steps belong at DEBUG): by message %v", name, n, max, count)
	}
}

// TestFullRestart kills every shardd and every NATS server, then starts
// them again on the same stores: the shard table, the lease history (the
// next coordinator's epoch is above the last) and every kv entity's state
// come back.
func TestFullRestart(t *testing.T) {
	d := newDeployment(t, "127.0.0.1", "--min-regions", "3")
	regions := []string{"a", "b", "c"}
	for _, r := range regions {
		d.start(r)
	}
	st := d.settled(60*time.Second, regions...)
	seedEntities(t, d.nc, d.subjects, st.Shards)
	table, epoch := readTable(t, d.nc), st.Coordinator.Epoch

	for _, r := range regions {
		d.procs[r].kill()
	}
	for i := range 3 {
		d.nats.procs[i].kill()
	}
	t0 := time.Now()
	for i := range 3 {
		d.nats.start(i)
	}
	d.nats.waitHealthy(90 * time.Second)
	if got := readTable(t, d.nc); len(got) != len(table) {
		t.Fatalf("after the restart the table has %d rows, had %d", len(got), len(table))
	} else {
		for s, r := range table {
			if got[s] != r {
				t.Errorf("shard %d: %+v after the restart, %+v before", s, got[s], r)
			}
		}
	}
	for _, r := range regions {
		d.start(r)
	}
	st = d.settled(90*time.Second, regions...)
	t.Logf("full restart: NATS healthy and shardd settled %s after the servers started; coordinator epoch %d -> %d",
		time.Since(t0).Round(time.Millisecond), epoch, st.Coordinator.Epoch)
	if st.Coordinator.Epoch <= epoch {
		t.Fatalf("coordinator epoch %d after the restart, %d before: the lease history was lost", st.Coordinator.Epoch, epoch)
	}
	assertSingleOwner(t, d.nc, d.subjects, st.Shards)
	assertEntities(t, d.nc, d.subjects, st.Shards)
}

// incrLoad increments a counter in each of n kv entities, one request at a
// time per entity, from several workers, and counts what was acknowledged.
type incrLoad struct {
	nc       *nats.Conn
	subjects protocol.Subjects
	shards   int
	acked    []atomic.Int64
	failed   []atomic.Int64
	sent     atomic.Int64
	// noResponders counts the failures that were "no responders" (the
	// shard had no subscriber: its owner had fenced, nobody parked it yet).
	noResponders atomic.Int64
	stop         chan struct{}
	wg           sync.WaitGroup
	firstErr     atomic.Value
}

func startIncrLoad(t *testing.T, url string, subjects protocol.Subjects, shards, n, workers int) *incrLoad {
	l := &incrLoad{nc: connect(t, url), subjects: subjects, shards: shards,
		acked: make([]atomic.Int64, n), failed: make([]atomic.Int64, n), stop: make(chan struct{})}
	for w := range workers {
		l.wg.Go(func() {
			for {
				for i := w; i < n; i += workers {
					select {
					case <-l.stop:
						return
					default:
					}
					// With Nats-Msg-Id, as docs/FAULTS.md's "Guarantees" ask
					// of publishers that want exactly once through planned
					// moves.
					m := nats.NewMsg(subjects.EntityOf(l.id(i), shards))
					m.Data = []byte(`{"op":"incr","key":"c"}`)
					m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s-%d", l.id(i), l.sent.Add(1)))
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					reply, err := l.nc.RequestMsgWithContext(ctx, m)
					cancel()
					if err == nil && reply.Header.Get(protocol.HeaderError) != "" {
						err = errors.New(reply.Header.Get(protocol.HeaderError))
					}
					if err != nil {
						l.failed[i].Add(1)
						l.firstErr.CompareAndSwap(nil, fmt.Sprintf("%s: %v", l.id(i), err))
						if errors.Is(err, nats.ErrNoResponders) {
							l.noResponders.Add(1)
						}
						// As a client would: no responders comes back at
						// once while a shard has nobody subscribed.
						time.Sleep(100 * time.Millisecond)
						continue
					}
					l.acked[i].Add(1)
				}
			}
		})
	}
	t.Cleanup(l.halt)
	return l
}

func (l *incrLoad) id(i int) string { return fmt.Sprintf("load-%d", i) }

func (l *incrLoad) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

// check reads every counter: it must be at least the acknowledged
// increments (nothing acknowledged was lost). strict (planned moves, with
// Nats-Msg-Id: exactly once): no request failed and none was handled
// twice; otherwise (at least once after a crash) the excess is reported.
func (l *incrLoad) check(t *testing.T, strict bool) {
	t.Helper()
	var acked, failed, excess int64
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range l.acked {
		a, f := l.acked[i].Load(), l.failed[i].Load()
		acked, failed = acked+a, failed+f
		out, err := kvRequest(ctx, l.nc, l.subjects.EntityOf(l.id(i), l.shards), `{"op":"get","key":"c"}`)
		if err != nil {
			t.Fatalf("read %s: %v", l.id(i), err)
		}
		var got int64
		if v, ok := out["value"].(float64); ok {
			got = int64(v)
		}
		if got < a {
			t.Errorf("%s is %d after %d acknowledged increments: acknowledged increments lost", l.id(i), got, a)
		}
		if got > a+f {
			excess += got - a - f
			if strict {
				t.Errorf("%s is %d after %d acknowledged and %d failed increments: handled twice", l.id(i), got, a, f)
			}
		}
	}
	t.Logf("load: %d increments acknowledged, %d failed (%d of them no responders; first: %v), %d handled twice", acked, failed, l.noResponders.Load(), l.firstErr.Load(), excess)
	if strict && failed > 0 {
		t.Errorf("%d requests failed during planned moves (first: %v)", failed, l.firstErr.Load())
	}
}

// logTime returns the time of the first line of p's log that contains
// text, from the line's time= field.
func (p *proc) logTime(t *testing.T, text string) time.Time {
	t.Helper()
	var at time.Time
	natstest.Eventually(t, 30*time.Second, fmt.Sprintf("%q in the log of %s", text, p.name), func() error {
		sc := bufio.NewScanner(strings.NewReader(p.log.String()))
		for sc.Scan() {
			line := sc.Text()
			if !strings.Contains(line, text) {
				continue
			}
			var err error
			at, err = lineTime(line)
			return err
		}
		return errors.New("not logged")
	})
	return at
}

// lineTime is the time of a line of a process's log (slog's text format:
// "time=... level=...").
func lineTime(line string) (time.Time, error) {
	field, _, _ := strings.Cut(strings.TrimPrefix(line, "time="), " ")
	return time.Parse(time.RFC3339Nano, field)
}

// fencedLine is what a region logs when it fences (region.Core).
const fencedLine = "fenced: stopped serving every shard"

// fenced reports whether region p's log says it fenced.
func (p *proc) fenced() bool { return strings.Contains(p.log.String(), fencedLine) }

// queryHeld asks region id which shards it holds.
func queryHeld(t *testing.T, nc *nats.Conn, subjects protocol.Subjects, id string) []int {
	t.Helper()
	m, err := nc.Request(subjects.Query(id), []byte("{}"), 2*time.Second)
	if err != nil {
		t.Fatalf("query region %s: %v", id, err)
	}
	var a protocol.QueryAnswer
	if err := json.Unmarshal(m.Data, &a); err != nil {
		t.Fatalf("query region %s: %q: %v", id, m.Data, err)
	}
	var held []int
	for _, s := range a.Shards {
		held = append(held, s.Shard)
	}
	return held
}

func adminRequest(nc *nats.Conn, subjects protocol.Subjects, verb string, req, answer any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	m, err := nc.Request(subjects.Admin(verb), body, 5*time.Second)
	if err != nil {
		return err
	}
	if e := m.Header.Get(protocol.HeaderError); e != "" {
		return fmt.Errorf("%s: %s", verb, e)
	}
	return json.Unmarshal(m.Data, answer)
}

// countReplies sends a request to an inbox and counts the answers that
// arrive within a second.
func countReplies(t *testing.T, nc *nats.Conn, subject string, body []byte) int {
	t.Helper()
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.PublishRequest(subject, inbox, body); err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		if _, err := sub.NextMsg(time.Second); err != nil {
			return n
		}
		n++
	}
}

// streamLeaders names the servers leading the KV bucket's stream and the
// buffer stream.
func streamLeaders(t *testing.T, nc *nats.Conn) string {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, stream := range []string{"KV_natshard_kv", "natshard_buf_kv"} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		s, err := js.Stream(ctx, stream)
		cancel()
		if err != nil || s.CachedInfo().Cluster == nil {
			names = append(names, stream+" ?")
			continue
		}
		names = append(names, stream+" "+s.CachedInfo().Cluster.Leader)
	}
	return strings.Join(names, ", ")
}

// bucket opens the kv type's KV bucket.
func bucket(t *testing.T, nc *nats.Conn) jetstream.KeyValue {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var kv jetstream.KeyValue
	natstest.Eventually(t, 30*time.Second, "the KV bucket", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		kv, err = js.KeyValue(ctx, "natshard_kv")
		return err
	})
	return kv
}

// readTable reads the shard table from KV.
func readTable(t *testing.T, nc *nats.Conn) map[int]protocol.ShardRecord {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	table := map[int]protocol.ShardRecord{}
	natstest.Eventually(t, 30*time.Second, "the shard table", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		store, err := kvstate.Bind(ctx, js, "kv", kvstate.Options{})
		if err != nil {
			return err
		}
		rows, err := store.Shards(ctx)
		for _, r := range rows {
			table[r.Shard] = r
		}
		return err
	})
	return table
}

// assertRowsOfTerm checks the history of the table: every row written at
// or after revision term carries an epoch of at least term, that is, was
// written by that term's coordinator or a later one.
func assertRowsOfTerm(t *testing.T, nc *nats.Conn, term uint64) {
	t.Helper()
	rows := 0
	eachShardRow(t, nc, func(rev uint64, r protocol.ShardRecord) {
		if rev < term {
			return
		}
		rows++
		if r.Epoch < term {
			t.Errorf("shard %d row of revision %d has epoch %d, from before the term that began at %d", r.Shard, rev, r.Epoch, term)
		}
	})
	t.Logf("%d table rows written since revision %d, all of that term or later", rows, term)
}

// eachShardRow calls f with each row in the table's history (what the
// bucket keeps of it) and its revision.
func eachShardRow(t *testing.T, nc *nats.Conn, f func(uint64, protocol.ShardRecord)) {
	t.Helper()
	kv := bucket(t, nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := kv.Watch(ctx, "shards.>", jetstream.IgnoreDeletes(), jetstream.IncludeHistory())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	for e := range w.Updates() {
		if e == nil {
			return // the initial values are all delivered
		}
		var r protocol.ShardRecord
		if err := protocol.Decode(e.Value(), &r); err != nil {
			t.Fatalf("%s revision %d: %v", e.Key(), e.Revision(), err)
		}
		f(e.Revision(), r)
	}
	t.Fatal("the watch of the table ended early")
}
