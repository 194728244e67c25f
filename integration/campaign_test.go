package integration

// The randomized fault campaign (issue 30, docs/FAULTS.md, "Guarantees":
// proven by search; docs/FAULTS.md, "Randomized fault campaign"): real
// processes, seeded faults from a menu, an appending load and a history
// checker (internal/campaign) that knows natshard only by its subjects and the
// kv entity's JSON.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/natshard/natshard/kvstate"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/campaign"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

var (
	campaignDuration = flag.Duration("campaign.duration", 40*time.Second, "TestCampaign: how long the load runs under faults, per seed and mode")
	campaignSeeds    = flag.String("campaign.seeds", "", "TestCampaign: seeds of the fault schedules, comma-separated; empty: 171 in core delivery and 81 in durable (their 40 s schedules draw 8 kinds of fault each, 10 of the 11 between them)")
	campaignModes    = flag.String("campaign.modes", "core,durable", "TestCampaign: delivery modes, comma-separated")
	campaignRate     = flag.Int("campaign.rate", 0, "TestCampaign: appends/s in all; 0: 300 with the race detector, 1500 without")
	campaignEntities = flag.Int("campaign.entities", 1000, "TestCampaign: kv entities appended to")
	campaignKinds    = flag.String("campaign.kinds", "", "TestCampaign: the fault menu, comma-separated kinds (internal/campaign.Kinds); empty: all")
	campaignShardd   = flag.String("campaign.shardd", "", "TestCampaign: more shardd flags, space-separated (such as --handoff-timeout=3s)")
)

const (
	campaignRegions = 4
	campaignShards  = 128
	campaignType    = "kv"
)

// TestCampaign runs, for each seed and delivery mode, three nats-server
// processes (JetStream, R3; their routes through proxies), four shardd
// --replicas 3 of a kv type (each one's client connections through its own
// proxies), a load of numbered appends to 1 000 entities (half with a
// Nats-Msg-Id) and the seed's schedule of faults; then it heals everything,
// reads every entity's history and checks it. It fails on what
// docs/FAULTS.md's "Guarantees" forbid: in durable delivery any value lost,
// applied twice or out of order; in core delivery a keyed value applied twice
// or out of order (and, in both, a value applied that was never sent). Core
// losses are reported with the faults in force, not failed on.
//
// Long runs (docs/FAULTS.md): go test -count=1 -timeout 60m -v -run
// TestCampaign ./integration/ -args -campaign.duration 90s -campaign.seeds 1,2,3
func TestCampaign(t *testing.T) {
	seedsOf := func(mode campaign.Mode) []uint64 {
		list := *campaignSeeds
		if list == "" {
			list = map[campaign.Mode]string{campaign.Core: "171", campaign.Durable: "81"}[mode]
		}
		var seeds []uint64
		for s := range strings.SplitSeq(list, ",") {
			seed, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
			if err != nil {
				t.Fatalf("-campaign.seeds %q: %v", list, err)
			}
			seeds = append(seeds, seed)
		}
		return seeds
	}
	var kinds []campaign.Kind
	if *campaignKinds != "" {
		for k := range strings.SplitSeq(*campaignKinds, ",") {
			if !slices.Contains(campaign.Kinds, campaign.Kind(k)) {
				t.Fatalf("-campaign.kinds: %q is not one of %v", k, campaign.Kinds)
			}
			kinds = append(kinds, campaign.Kind(k))
		}
	}
	rate := *campaignRate
	if rate == 0 {
		rate = 1500
		if raceEnabled {
			rate = 300
		}
	}
	for mode := range strings.SplitSeq(*campaignModes, ",") {
		m := campaign.Mode(mode)
		if m != campaign.Core && m != campaign.Durable {
			t.Fatalf("-campaign.modes: %q is neither core nor durable", mode)
		}
		for _, seed := range seedsOf(m) {
			t.Run(fmt.Sprintf("%s/seed=%d", mode, seed), func(t *testing.T) {
				runCampaign(t, m, seed, kinds, rate)
			})
		}
	}
}

// campaignRun is one run's processes and fault log.
type campaignRun struct {
	t     *testing.T
	mode  campaign.Mode
	seed  uint64
	nats  *natsCluster
	nc    *nats.Conn // straight to the servers: admin, load's reads
	start time.Time  // of the load, set before the faults begin
	// began is start, for logf, whose callers may run before it is set.
	began atomic.Pointer[time.Time]

	routeGates [3][3]*gate // [from][to]: server from's routes to server to

	mu      sync.Mutex
	regions [campaignRegions]*campRegion
	faults  []campaign.Fault // as carried out: the times they started and healed
	skipped int
	exits   int // regions that exited by themselves and were started again
}

// campRegion is a shardd and its link.
type campRegion struct {
	name   string
	gate   *gate
	urls   string // its proxies' URLs, one per server
	proc   *proc
	starts int
	fault  int // the id of the fault it bears, 0 if none
}

func runCampaign(t *testing.T, mode campaign.Mode, seed uint64, kinds []campaign.Kind, rate int) {
	r := &campaignRun{t: t, mode: mode, seed: seed}
	for i := range 3 {
		for j := range 3 {
			r.routeGates[i][j] = newGate()
		}
	}
	r.nats = startNATSWith(t, "127.0.0.1", func(c *natsCluster) {
		var via [3][3]int
		for i := range 3 {
			for j := range 3 {
				if i != j {
					via[i][j] = startProxy(t, fmt.Sprintf("127.0.0.1:%d", c.route[j]), r.routeGates[i][j]).port()
				}
			}
		}
		c.routeVia = func(from, to int) int { return via[from][to] }
		// Clients learn no other server's address (shardd would reach it
		// past its proxies), nor servers another's route address (port 1:
		// refused, an implicit route is tried once): every route goes
		// through the proxies.
		c.extra = []string{"--no_advertise", "--cluster_advertise", "127.0.0.1:1", "-c", storeConfig(t)}
	})
	r.nats.waitHealthy(60 * time.Second)
	r.nc = connect(t, r.nats.urls("127.0.0.1"))
	for i := range campaignRegions {
		g := newGate()
		var urls []string
		for s := range 3 {
			urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", startProxy(t, fmt.Sprintf("127.0.0.1:%d", r.nats.client[s]), g).port()))
		}
		r.regions[i] = &campRegion{name: fmt.Sprintf("r%d", i), gate: g, urls: strings.Join(urls, ",")}
	}
	for i := range campaignRegions {
		r.startRegion(i)
	}
	// A region that exits by itself (one started while JetStream is not
	// ready yet does, issue 30) is started again, from the start.
	stopWatch := make(chan struct{})
	var watch sync.WaitGroup
	watch.Go(func() { r.watchExits(stopWatch) })
	subjects := protocol.MustSubjects("", "", campaignType)
	waitSettled(t, r.nc, subjects, 120*time.Second, r.names()...)

	faults := campaign.Schedule(seed, campaign.Config{
		Duration: *campaignDuration, Regions: campaignRegions, Servers: 3, Shards: campaignShards, Kinds: kinds,
	})
	t.Logf("campaign: %s seed %d: %d faults scheduled over %s at %d appends/s to %d entities", mode, seed, len(faults), *campaignDuration, rate, *campaignEntities)

	load := startCampaignLoad(t, r.nats.urls("127.0.0.1"), mode, *campaignEntities, rate)
	r.start = load.start
	r.began.Store(&r.start)
	var wg sync.WaitGroup
	for _, f := range faults {
		wg.Go(func() { r.carryOut(f) })
	}
	time.Sleep(time.Until(r.start.Add(*campaignDuration)))
	wg.Wait()
	load.halt()
	close(stopWatch)
	watch.Wait()

	// Heal everything, and wait for every region to serve.
	r.healAll()
	r.logf("everything healed; waiting for the 4 regions to settle")
	r.nats.waitHealthy(120 * time.Second)
	settleStart := time.Now()
	waitSettled(t, r.nc, subjects, 180*time.Second, r.names()...)
	r.logf("settled %s after the heal", time.Since(settleStart).Round(time.Millisecond))

	entities := load.read(t, r.nc)
	rep := campaign.Check(mode, entities, r.faults)
	byKind := map[campaign.Kind]int{}
	for _, f := range r.faults {
		byKind[f.Kind]++
	}
	var kindsLine []string
	for _, k := range campaign.Kinds {
		if byKind[k] > 0 {
			kindsLine = append(kindsLine, fmt.Sprintf("%s %d", k, byKind[k]))
		}
	}
	t.Logf("campaign: %s seed %d: %s of load, %d faults carried out (%s), %d skipped, %d regions exited by themselves; %d publishes",
		mode, seed, *campaignDuration, len(r.faults), strings.Join(kindsLine, ", "), r.skipped, r.exits, load.tries.Load())
	for _, line := range load.reasons() {
		t.Log(line)
	}
	for _, line := range rep.Lines(3) {
		t.Log(line)
	}
	if failures := rep.Failures(); len(failures) > 0 {
		if mode == campaign.Durable {
			for _, line := range r.explainLost(rep, 20) {
				t.Log(line)
			}
		}
		t.Errorf("campaign: %s seed %d FAILED: %v (docs/FAULTS.md, Guarantees; the examples and their faults are above)", mode, seed, failures)
	}
	if rep.Keyed.Sent[campaign.Acked]+rep.Keyed.Sent[campaign.Sent] == 0 {
		t.Errorf("campaign: %s seed %d: no value acknowledged", mode, seed)
	}
}

func (r *campaignRun) names() []string {
	var names []string
	for _, g := range r.regions {
		names = append(names, g.name)
	}
	return names
}

// logf adds a line to the fault log, with the time since the load began.
func (r *campaignRun) logf(format string, args ...any) {
	at := "before the load"
	if start := r.began.Load(); start != nil {
		at = fmt.Sprintf("t=%s", time.Since(*start).Round(time.Millisecond))
	}
	line := fmt.Sprintf("campaign: %s seed %d %s %s: %s", r.mode, r.seed, time.Now().UTC().Format("15:04:05.000"), at, fmt.Sprintf(format, args...))
	r.t.Log(line)
}

// startRegion starts region i (again), through its proxies.
func (r *campaignRun) startRegion(i int) {
	g := r.regions[i]
	g.starts++
	g.proc = startShardd(r.t, fmt.Sprintf("%s-%d", g.name, g.starts), r.sharddArgs(i)...)
}

// sharddArgs are the flags every shardd of the run is given.
func (r *campaignRun) sharddArgs(i int) []string {
	g := r.regions[i]
	args := []string{"--region", g.name, "--nats", g.urls,
		"--type", campaignType, "--kind", "kv", "--replicas", "3", "--delivery", string(r.mode),
		"--shards", strconv.Itoa(campaignShards), "--min-regions", strconv.Itoa(campaignRegions),
		"--bucket-bytes", campaignBucketBytes, "--buffer-bytes", campaignBufferBytes, "--stream-bytes", campaignStreamBytes}
	return append(args, strings.Fields(*campaignShardd)...)
}

// A store small enough to fill safely (fill-store): each server's
// JetStream store holds campaignStore; natshard's streams reserve their
// limits in it, the filler takes the rest.
const (
	campaignStore       = "64MiB"
	campaignBucketBytes = "8MiB"
	campaignBufferBytes = "16MiB"
	campaignStreamBytes = "16MiB"
	fillStream          = "campaign_fill"
)

// storeConfig writes the servers' configuration file: the store's limit.
func storeConfig(t *testing.T) string {
	f := filepath.Join(t.TempDir(), "store.conf")
	if err := os.WriteFile(f, []byte("jetstream {\n  max_file_store: "+campaignStore+"\n}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

// fillStore starts filling the servers' stores with a stream of no
// limit, R3, 256 KiB messages published asynchronously (up to 32 in
// flight, so that the store fills within the fault's 1-10 s even on a
// busy machine), until they refuse it or stop is called; stop returns
// what was stored and how it ended.
func (r *campaignRun) fillStore() (stop func() string) {
	js, err := jetstream.New(r.nc, jetstream.WithPublishAsyncMaxPending(32), jetstream.WithPublishAsyncTimeout(5*time.Second))
	if err != nil {
		return func() string { return err.Error() }
	}
	ctx, cancel := context.WithCancel(context.Background())
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = js.CreateOrUpdateStream(cctx, jetstream.StreamConfig{
		Name: fillStream, Subjects: []string{"campaign.fill"}, Storage: jetstream.FileStorage, Replicas: 3,
	})
	ccancel()
	if err != nil {
		cancel()
		return func() string { return fmt.Sprintf("creating stream %s: %v", fillStream, err) }
	}
	began := time.Now()
	var (
		stored, failed int
		lastErr        error
		ended          string
		wg             sync.WaitGroup
	)
	acks := make(chan jetstream.PubAckFuture, 64)
	wg.Go(func() { // publishes until told to stop or refused
		defer close(acks)
		chunk := make([]byte, 256<<10)
		for ctx.Err() == nil {
			f, err := js.PublishAsync("campaign.fill", chunk)
			if err != nil {
				if ctx.Err() == nil {
					wait.Sleep(ctx, 50*time.Millisecond)
				}
				continue
			}
			acks <- f
		}
	})
	wg.Go(func() { // reads the acknowledgements; the only writer of the counts
		for f := range acks {
			select {
			case <-f.Ok():
				stored++
			case err := <-f.Err():
				switch {
				case strings.Contains(err.Error(), "insufficient resources"):
					if ended == "" {
						ended = fmt.Sprintf("refused after %s: %v", time.Since(began).Round(time.Millisecond), err)
					}
					cancel()
				case ctx.Err() == nil:
					failed++
					lastErr = err
				}
			}
		}
	})
	return func() string {
		cancel()
		wg.Wait()
		if ended == "" {
			ended = "never refused"
		}
		if failed > 0 {
			ended += fmt.Sprintf("; %d other publish errors, the last: %v", failed, lastErr)
		}
		return fmt.Sprintf("stored %d KiB in stream %s, %s", stored*256, fillStream, ended)
	}
}

// emptyStore deletes the filler's stream, trying for 30 s.
func (r *campaignRun) emptyStore() string {
	js, err := jetstream.New(r.nc)
	if err != nil {
		return err.Error()
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := js.DeleteStream(ctx, fillStream)
		cancel()
		if err == nil || errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Sprintf("stream %s deleted", fillStream)
		}
		if time.Now().After(deadline) {
			return fmt.Sprintf("deleting stream %s: %v", fillStream, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func exited(p *proc) bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// watchExits starts again a region that exited by itself (a shardd
// started during a JetStream election exits: issue 30), while it bears no
// fault.
func (r *campaignRun) watchExits(stop <-chan struct{}) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		r.mu.Lock()
		for i, g := range r.regions {
			if g.fault == 0 && exited(g.proc) {
				r.exits++
				r.mu.Unlock()
				r.logf("region %s exited by itself (%v; its last line: %s); starting it again", g.name, g.proc.exitErr, strings.TrimSpace(lastLines(strings.TrimSpace(g.proc.log.String()), 1)))
				r.mu.Lock()
				r.startRegion(i)
			}
		}
		r.mu.Unlock()
	}
}

// carryOut waits for f's time, starts it, waits for its heal and heals it.
func (r *campaignRun) carryOut(f campaign.Fault) {
	time.Sleep(time.Until(r.start.Add(f.At)))
	region := f.Region
	if f.Kind == campaign.KillCoordinator {
		// The coordinator may be changing hands: asked for 5 s.
		var st protocol.Status
		var err error
		for try := 0; try < 10; try++ {
			if st, err = status(r.nc, protocol.MustSubjects("", "", campaignType)); err == nil {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		if err != nil {
			r.skip(f, fmt.Sprintf("no coordinator status: %v", err))
			return
		}
		region = slices.Index(r.names(), st.Coordinator.Region)
		if region < 0 {
			r.skip(f, fmt.Sprintf("the coordinator is %q", st.Coordinator.Region))
			return
		}
	}
	var g *campRegion
	if region >= 0 && f.Kind != campaign.MoveShard {
		g = r.regions[region]
		r.mu.Lock()
		busy := g.fault
		if busy == 0 {
			g.fault = f.ID
		}
		r.mu.Unlock()
		if busy != 0 {
			r.skip(f, fmt.Sprintf("region %s bears fault #%d", g.name, busy))
			return
		}
		defer func() {
			r.mu.Lock()
			g.fault = 0
			r.mu.Unlock()
		}()
	}
	began := time.Since(r.start)
	what := f.String()
	if f.Kind == campaign.KillCoordinator {
		what += fmt.Sprintf(" (region %s)", g.name)
	}
	r.logf("start %s", what)
	var heal func()
	switch f.Kind {
	case campaign.KillRegion, campaign.KillCoordinator:
		g.proc.kill()
		heal = func() { r.restartRegion(region) }
	case campaign.TermRegion:
		_ = g.proc.cmd.Process.Signal(syscall.SIGTERM)
		heal = func() {
			select {
			case <-g.proc.done:
			case <-time.After(60 * time.Second):
				r.logf("region %s did not exit within 60 s of its SIGTERM; kill -9", g.name)
			}
			r.restartRegion(region)
		}
	case campaign.StopRegion:
		_ = g.proc.cmd.Process.Signal(syscall.SIGSTOP)
		heal = func() { _ = g.proc.cmd.Process.Signal(syscall.SIGCONT) }
	case campaign.PartitionRegion:
		g.gate.shut()
		heal = g.gate.reopen
	case campaign.KillServer:
		r.nats.procs[f.Server].kill()
		heal = func() { r.nats.start(f.Server) }
	case campaign.IsolateServer:
		for j := range 3 {
			if j != f.Server {
				r.cutRoutes(f.Server, j)
			}
		}
		heal = func() {
			for j := range 3 {
				if j != f.Server {
					r.healRoutes(f.Server, j)
				}
			}
		}
	case campaign.SplitServers:
		r.cutRoutes(f.Server, f.Peer)
		heal = func() { r.healRoutes(f.Server, f.Peer) }
	case campaign.MoveShard:
		out, _ := r.shardctl("move", strconv.Itoa(f.Shard), r.regions[f.Region].name)
		r.logf("  %s", out)
	case campaign.FillStore:
		stop := r.fillStore()
		heal = func() {
			r.logf("  %s", stop())
			r.logf("  %s", r.emptyStore())
		}
	case campaign.DrainRegion:
		out, _ := r.shardctl("drain", g.name)
		r.logf("  %s", out)
		heal = func() { r.undrain(g.name) }
	}
	if heal != nil {
		time.Sleep(time.Until(r.start.Add(f.Heal)))
		heal()
		r.logf("healed %s", what)
	}
	done := f
	done.At, done.Heal = began, max(time.Since(r.start), began)
	if f.Kind == campaign.MoveShard {
		done.Heal = began
	}
	if f.Kind == campaign.KillCoordinator {
		done.Region = region
	}
	r.mu.Lock()
	r.faults = append(r.faults, done)
	slices.SortFunc(r.faults, func(a, b campaign.Fault) int { return a.ID - b.ID })
	r.mu.Unlock()
}

// faultsOf returns the faults of kind k carried out so far.
func (r *campaignRun) faultsOf(k campaign.Kind) []campaign.Fault {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []campaign.Fault
	for _, f := range r.faults {
		if f.Kind == k {
			out = append(out, f)
		}
	}
	return out
}

func (r *campaignRun) skip(f campaign.Fault, why string) {
	r.mu.Lock()
	r.skipped++
	r.mu.Unlock()
	r.logf("skipped %s: %s", f, why)
}

func (r *campaignRun) restartRegion(i int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.regions[i].proc.kill()
	r.startRegion(i)
}

func (r *campaignRun) cutRoutes(a, b int) {
	r.routeGates[a][b].shut()
	r.routeGates[b][a].shut()
}

func (r *campaignRun) healRoutes(a, b int) {
	r.routeGates[a][b].reopen()
	r.routeGates[b][a].reopen()
}

// shardctl runs shardctl with args against the servers and returns what it
// said.
func (r *campaignRun) shardctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	all := append([]string{"--nats", r.nats.urls("127.0.0.1"), "--type", campaignType}, args...)
	out, err := exec.CommandContext(ctx, filepath.Join(binDir, "shardctl"), all...).CombinedOutput()
	s := fmt.Sprintf("shardctl %s: %s", strings.Join(args, " "), strings.TrimSpace(string(out)))
	if err != nil {
		s += fmt.Sprintf(" (%v)", err)
	}
	return s, err
}

// healAll ends every fault still in force: links and routes forward,
// stopped regions continue, dead processes start again, drained regions
// take shards.
func (r *campaignRun) healAll() {
	for i := range 3 {
		for j := range 3 {
			r.routeGates[i][j].reopen()
		}
		if exited(r.nats.procs[i]) {
			r.nats.start(i)
		}
	}
	if len(r.faultsOf(campaign.FillStore)) > 0 {
		r.logf("  %s", r.emptyStore())
	}
	for i, g := range r.regions {
		g.gate.reopen()
		_ = g.proc.cmd.Process.Signal(syscall.SIGCONT)
		if exited(g.proc) {
			r.logf("region %s was not running at the end; starting it", g.name)
			r.mu.Lock()
			r.startRegion(i)
			r.mu.Unlock()
		}
	}
}

// undrain lets region name take shards again, trying for 60 s (the
// coordinator may be down, or the region not registered yet).
func (r *campaignRun) undrain(name string) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := r.shardctl("undrain", name)
		r.logf("  %s", out)
		if err == nil || time.Now().After(deadline) {
			return
		}
		time.Sleep(time.Second)
	}
}

// campaignLoad appends numbered values to entities and records every
// send's outcome.
type campaignLoad struct {
	mode  campaign.Mode
	conns []*nats.Conn
	js    []jetstream.JetStream
	n     int
	start time.Time
	stop  chan struct{}
	wg    sync.WaitGroup
	tries atomic.Int64

	mu    sync.Mutex
	sends [][]campaign.Send
}

func campaignEntity(i int) string { return fmt.Sprintf("c-%d", i) }

// startCampaignLoad starts a sender per entity that sends its next value
// (1, 2, 3...) once the last one's outcome is known, at about rate
// values/s in all. Even entities carry a Nats-Msg-Id (a keyed value
// refused, or in durable delivery not acknowledged, is sent again with
// it); odd ones none (sent once). Core delivery: one value in four is a
// request, the others publishes. Durable delivery: publishes to the stream.
func startCampaignLoad(t *testing.T, url string, mode campaign.Mode, n, rate int) *campaignLoad {
	l := &campaignLoad{mode: mode, n: n, stop: make(chan struct{}), sends: make([][]campaign.Send, n)}
	for range 4 {
		nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		l.conns = append(l.conns, nc)
		l.js = append(l.js, js)
	}
	// One sender per entity, so that an entity waiting for an answer
	// holds up no other; their ticks spread over the period.
	every := time.Duration(n) * time.Second / time.Duration(rate)
	l.start = time.Now()
	for i := range n {
		l.wg.Go(func() {
			select {
			case <-l.stop:
				return
			case <-time.After(every * time.Duration(i) / time.Duration(n)):
			}
			tick := time.NewTicker(every)
			defer tick.Stop()
			for v := 1; ; v++ {
				l.send(i, v)
				select {
				case <-l.stop:
					return
				case <-tick.C:
				}
			}
		})
	}
	return l
}

// numbers in a reason (entity ids, revisions) are one reason's.
var numbers = regexp.MustCompile(`[0-9]+`)

// reasons are "campaign:" lines counting the reasons of the unknown and
// refused outcomes, the five most frequent of each.
func (l *campaignLoad) reasons() []string {
	counts := map[campaign.Outcome]map[string]int{}
	for _, sends := range l.sends {
		for _, s := range sends {
			if s.Outcome != campaign.Unknown && s.Outcome != campaign.Refused {
				continue
			}
			if counts[s.Outcome] == nil {
				counts[s.Outcome] = map[string]int{}
			}
			why := s.Why
			if _, rest, ok := strings.Cut(why, ": "); ok && strings.HasPrefix(why, "try ") {
				why = rest
			}
			counts[s.Outcome][numbers.ReplaceAllString(why, "N")]++
		}
	}
	var lines []string
	for _, o := range []campaign.Outcome{campaign.Unknown, campaign.Refused} {
		type reason struct {
			why string
			n   int
		}
		var rs []reason
		for why, n := range counts[o] {
			rs = append(rs, reason{why, n})
		}
		slices.SortFunc(rs, func(a, b reason) int { return b.n - a.n })
		var parts []string
		for _, r := range rs[:min(5, len(rs))] {
			parts = append(parts, fmt.Sprintf("%d %q", r.n, r.why))
		}
		if len(parts) > 0 {
			lines = append(lines, fmt.Sprintf("campaign: %s %s because: %s", l.mode, o, strings.Join(parts, ", ")))
		}
	}
	return lines
}

func (l *campaignLoad) halt() {
	close(l.stop)
	l.wg.Wait()
}

// send sends value v to entity i and records its outcome.
func (l *campaignLoad) send(i, v int) {
	nc, js := l.conns[i%len(l.conns)], l.js[i%len(l.js)]
	id := campaignEntity(i)
	keyed := i%2 == 0
	at := time.Since(l.start)
	outcome, why := campaign.Unknown, ""
	for try := 0; try < 10; try++ {
		m := nats.NewMsg(campaign.Subject(campaignType, id, campaignShards))
		m.Data = fmt.Appendf(nil, `{"op":"append","key":"v","value":%d}`, v)
		if keyed {
			m.Header.Set("Nats-Msg-Id", fmt.Sprintf("%s-%d", id, v))
		}
		l.tries.Add(1)
		switch {
		case l.mode == campaign.Durable:
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			ack, err := js.PublishMsg(ctx, m)
			cancel()
			outcome, why = campaign.Acked, ""
			switch {
			case err == nil:
				// The stream's sequence, for the report of a lost value:
				// region logs and the servers' name messages by it.
				why = fmt.Sprintf("stream seq %d", ack.Sequence)
			case strings.Contains(err.Error(), "maximum bytes exceeded"), strings.Contains(err.Error(), "insufficient resources"):
				// The stream's leader refused it for lack of space.
				outcome, why = campaign.Refused, err.Error()
			default:
				outcome, why = campaign.Unknown, err.Error()
			}
		case v%4 == 0:
			reply, err := nc.RequestMsg(m, 2*time.Second)
			outcome, why = requestOutcome(reply, err)
		default:
			outcome, why = campaign.Sent, ""
			if err := nc.PublishMsg(m); err != nil {
				outcome, why = campaign.Refused, err.Error() // not sent: the connection is closed
			}
		}
		if try > 0 {
			why = fmt.Sprintf("try %d: %s", try+1, why)
		}
		// A keyed value is sent again, with its key, when it surely was
		// not handled, or (durable) when the stream did not say it
		// stored it (its duplicate window holds the key 2 minutes). Core
		// delivery remembers keys only in a move, so a request that got
		// no answer is not sent again there.
		again := keyed && (outcome == campaign.Refused || (l.mode == campaign.Durable && outcome == campaign.Unknown))
		if !again {
			break
		}
		select {
		case <-l.stop:
			try = 10
		case <-time.After(200 * time.Millisecond):
		}
	}
	l.mu.Lock()
	l.sends[i] = append(l.sends[i], campaign.Send{Value: v, At: at, Outcome: outcome, Why: why})
	l.mu.Unlock()
}

// requestOutcome reads a core request's answer: ok, or refused by the
// region (no entity handled it), or no responders; anything else may have
// been handled.
func requestOutcome(reply *nats.Msg, err error) (campaign.Outcome, string) {
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return campaign.Refused, "no responders"
	case err != nil:
		return campaign.Unknown, err.Error()
	case reply.Header.Get("Natshard-Refused") != "":
		return campaign.Refused, "Natshard-Refused: " + reply.Header.Get("Natshard-Refused") + ": " + reply.Header.Get("Natshard-Error")
	case reply.Header.Get("Natshard-Error") != "":
		return campaign.Unknown, "Natshard-Error: " + reply.Header.Get("Natshard-Error")
	}
	var ans struct {
		OK bool `json:"ok"`
	}
	if json.Unmarshal(reply.Data, &ans) != nil || !ans.OK {
		return campaign.Unknown, fmt.Sprintf("answer %q", reply.Data)
	}
	return campaign.Acked, ""
}

// read gets every entity's history: a get request (core: a NATS request;
// durable: through the stream, with its inbox in Natshard-Reply, answered
// once everything before it in the shard was handled).
func (l *campaignLoad) read(t *testing.T, nc *nats.Conn) []campaign.Entity {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	entities := make([]campaign.Entity, l.n)
	errs := make([]error, l.n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for i := range l.n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			id := campaignEntity(i)
			var h []int
			h, errs[i] = readHistory(nc, js, l.mode, id)
			entities[i] = campaign.Entity{ID: id, Keyed: i%2 == 0, Sends: l.sends[i], History: h}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("read entity %s: %v", campaignEntity(i), err)
		}
	}
	return entities
}

// readHistory reads entity id's array, trying for up to 2 minutes.
func readHistory(nc *nats.Conn, js jetstream.JetStream, mode campaign.Mode, id string) ([]int, error) {
	subject := campaign.Subject(campaignType, id, campaignShards)
	body := []byte(`{"op":"get","key":"v"}`)
	deadline := time.Now().Add(2 * time.Minute)
	var last error
	for time.Now().Before(deadline) {
		var data []byte
		if mode == campaign.Durable {
			data, last = durableGet(nc, js, subject, body)
		} else {
			var reply *nats.Msg
			reply, last = nc.Request(subject, body, 5*time.Second)
			if last == nil {
				if e := reply.Header.Get("Natshard-Error"); e != "" {
					last = fmt.Errorf("error: %s", e)
				}
				data = reply.Data
			}
		}
		if last != nil {
			time.Sleep(250 * time.Millisecond)
			continue
		}
		var ans struct {
			OK    bool  `json:"ok"`
			Value []int `json:"value"`
		}
		if err := json.Unmarshal(data, &ans); err != nil || !ans.OK {
			return nil, fmt.Errorf("answer %s: %v", data, err)
		}
		return ans.Value, nil
	}
	return nil, last
}

// durableGet publishes a request to the type's stream with its inbox in
// Natshard-Reply (docs/PROTOCOL.md, Durable delivery) and waits for the
// entity's answer; a refusal leaves the message in the stream, so it
// waits on.
func durableGet(nc *nats.Conn, js jetstream.JetStream, subject string, body []byte) ([]byte, error) {
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	m := nats.NewMsg(subject)
	m.Data = body
	m.Header.Set("Natshard-Reply", inbox)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.PublishMsg(ctx, m); err != nil {
		return nil, err
	}
	for {
		reply, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return nil, err
		}
		if reply.Header.Get("Natshard-Refused") != "" {
			continue
		}
		if e := reply.Header.Get("Natshard-Error"); e != "" {
			return nil, fmt.Errorf("error: %s", e)
		}
		return reply.Data, nil
	}
}

// explainLost says, for up to n values lost in durable delivery, what the
// servers hold of them at the end of the run: whether the stream still
// holds the value's message (then its consumer skipped it) or not (it was
// acknowledged, so a region took it and did not apply it, or the servers
// lost it), with the stream's and the shard consumer's state. Read from
// the stream's leader, before the servers stop.
func (r *campaignRun) explainLost(rep campaign.Report, n int) []string {
	js, err := jetstream.New(r.nc)
	if err != nil {
		return []string{err.Error()}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// The type's messages are split over streams, shard s in stream s
	// mod their number (docs/PROTOCOL.md, Durable delivery): each lost
	// value is looked for in its shard's.
	names := kvstate.MessageStreams(campaignType, kvstate.MessageStreamsFor(campaignShards))
	var lines []string
	streams := map[string]jetstream.Stream{}
	seenShard := map[int]bool{}
	for _, v := range rep.Violations {
		if v.Kind != campaign.Lost || n == 0 {
			continue
		}
		n--
		shard := campaign.Shard(v.Entity, campaignShards)
		name := names[shard%len(names)]
		stream, ok := streams[name]
		if !ok {
			var err error
			if stream, err = js.Stream(ctx, name); err != nil {
				lines = append(lines, fmt.Sprintf("lost values: stream %s: %v", name, err))
				continue
			}
			streams[name] = stream
			if info, err := stream.Info(ctx); err == nil {
				st := info.State
				lines = append(lines, fmt.Sprintf("lost values: stream %s holds %d messages, seq %d..%d, %d deleted; %s",
					name, st.Msgs, st.FirstSeq, st.LastSeq, st.NumDeleted, clusterState(info.Cluster)))
			}
		}
		var seq uint64
		at := strings.LastIndex(v.Why, "stream seq ")
		if _, err := fmt.Sscanf(v.Why[max(at, 0):], "stream seq %d", &seq); at < 0 || err != nil {
			lines = append(lines, fmt.Sprintf("  %s value %d (shard %d): no stream sequence (%q)", v.Entity, v.Value, shard, v.Why))
			continue
		}
		held := "not in the stream (acknowledged, or lost by the servers)"
		if m, err := stream.GetMsg(ctx, seq); err == nil {
			held = fmt.Sprintf("STILL IN THE STREAM on %s (never acknowledged: its consumer skipped it)", m.Subject)
		} else if !errors.Is(err, jetstream.ErrMsgNotFound) {
			held = "unknown: " + err.Error()
		}
		lines = append(lines, fmt.Sprintf("  %s value %d (shard %d, stream seq %d, sent at %s): %s",
			v.Entity, v.Value, shard, seq, v.At.Round(time.Millisecond), held))
		if seenShard[shard] {
			continue
		}
		seenShard[shard] = true
		c, err := stream.Consumer(ctx, fmt.Sprintf("shard-%d", shard))
		if err != nil {
			lines = append(lines, fmt.Sprintf("    consumer shard-%d: %v", shard, err))
			continue
		}
		ci := c.CachedInfo()
		lines = append(lines, fmt.Sprintf("    consumer shard-%d (created %s): delivered stream seq %d, ack floor %d, %d pending, %d unacknowledged, %d redelivered; %s",
			shard, ci.Created.Format("15:04:05.000"), ci.Delivered.Stream, ci.AckFloor.Stream, ci.NumPending, ci.NumAckPending, ci.NumRedelivered,
			clusterState(ci.Cluster)))
	}
	return lines
}

// clusterState names a stream's or consumer's leader and lists its
// replicas: name, whether current, and how far behind.
func clusterState(c *jetstream.ClusterInfo) string {
	if c == nil {
		return "no cluster information"
	}
	parts := []string{"leader " + c.Leader}
	for _, p := range c.Replicas {
		parts = append(parts, fmt.Sprintf("replica %s (current %v, lag %d)", p.Name, p.Current, p.Lag))
	}
	return strings.Join(parts, ", ")
}
