package bench

import (
	"cmp"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

var (
	flagRate       = flag.Float64("natshard.rate", 2000, "messages/s of BenchmarkHandoff's background publisher")
	flagDipRate    = flag.Float64("natshard.dip-rate", 3000, "messages/s of BenchmarkRebalanceDip's publisher")
	flagMinSamples = flag.Int("natshard.min-samples", 20, "moves BenchmarkHandoff measures at least, whatever b.N")
	flagLog        = flag.Bool("natshard.log", false, "log regions and coordinator at debug level to stderr")
	flagReport     = flag.String("natshard.report", "", "append the benchmarks' full reports (timelines, windows) to this file")
	flagGrace      = flag.Duration("natshard.grace", -1, "release grace of regions and coordinator; negative: none, as shardd's --release-grace auto on this standalone server")
)

// report appends text to the -natshard.report file, if any. (A
// benchmark's log is cut to 10 lines.)
func report(text string) {
	if *flagReport == "" {
		return
	}
	f, err := os.OpenFile(*flagReport, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench: report:", err)
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "%s %s\n%s\n", time.Now().Format(time.RFC3339), runtime.Version(), text)
}

const (
	entityType = "bench"
	shardCount = protocol.DefaultShards
	// coordInbox is the inbox prefix of the coordinator's connection: the
	// tracer sees the regions' answers to its commands there.
	coordInbox = "_BENCH_COORD"
)

// clock0 is the origin of every timestamp of the package: durations since
// it are monotonic and cheap to keep in atomics.
var clock0 = time.Now()

func now() time.Duration { return time.Since(clock0) }

// sysConfig configures a system.
type sysConfig struct {
	regions    []string
	minRegions int
	// rebalance is the coordinator's RebalanceInterval (negative: none).
	rebalance time.Duration
	// plain: regions host echo entities as they are, without the probe
	// (BenchmarkIdleEntities measures what they cost).
	plain bool
	// shards of the type; 0: shardCount. Entity subjects assume
	// shardCount: a system of another count carries no entity traffic.
	shards int
	// cluster: a three-server cluster and the type's bucket and buffer
	// with three replicas, instead of one server.
	cluster bool
}

func (c sysConfig) shardCount() int { return cmp.Or(c.shards, shardCount) }

// servers is the number of NATS servers, and of the type's replicas.
func (c sysConfig) servers() int {
	if c.cluster {
		return 3
	}
	return 1
}

// system is shardctl bench's system (benchlab.System: a NATS server with
// JetStream, regions and one coordinator, all in this process, each on its
// own connection) with the probes and the tracer of these benchmarks.
type system struct {
	*benchlab.System
	tb       testing.TB
	cfg      sysConfig
	subjects protocol.Subjects
	tracer   *tracer

	mu      sync.Mutex
	regions map[string]*node
	probes  atomic.Pointer[[]*probe] // every region's, for handled()

	// allocated is the time from the coordinator's start to every shard
	// active, balanced and served live, allocatedAt when it started
	// (tracer time).
	allocated, allocatedAt time.Duration

	closeMu sync.Mutex
	closers []func() // run in reverse by close
}

// node is one region and its probe.
type node struct {
	*benchlab.Region
	probe *probe
}

// stats are the region's counters.
func (n *node) stats() natshard.Stats {
	st, _ := n.Node.Stats(entityType)
	return st
}

// startSystem starts a system and waits until every shard is active.
func startSystem(tb testing.TB, cfg sysConfig) *system {
	tb.Helper()
	s := &system{tb: tb, cfg: cfg, regions: map[string]*node{}}
	s.probes.Store(&[]*probe{})
	tb.Cleanup(s.close)
	srv, err := benchlab.OpenServer("", cfg.servers())
	if err != nil {
		tb.Fatal(err)
	}
	s.onClose(srv.Close)
	log := slog.New(slog.DiscardHandler)
	if *flagLog {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s.System, err = benchlab.NewSystem(ctx, srv, benchlab.SystemConfig{
		Type: entityType, Kind: "echo", Shards: cfg.shardCount(), Replicas: cfg.servers(),
		MinRegions: cfg.minRegions, RebalanceInterval: cfg.rebalance, ReleaseGrace: *flagGrace,
		Logger: log, Entity: s.entity, CoordinatorInbox: coordInbox,
	})
	if err != nil {
		tb.Fatal(err)
	}
	s.onClose(s.System.Close)
	s.subjects = s.Subjects()
	s.tracer = startTracer(tb, s.connect("tracer"), s.subjects)
	s.onClose(s.tracer.stop)

	for _, id := range cfg.regions {
		s.startRegion(id)
	}
	s.allocatedAt = now()
	if err := s.StartCoordinator(ctx); err != nil {
		tb.Fatal(err)
	}
	s.waitSettled(30*time.Second + time.Duration(cfg.shardCount())*5*time.Millisecond)
	s.allocated = now() - s.allocatedAt
	return s
}

func (s *system) onClose(f func()) {
	s.closeMu.Lock()
	s.closers = append(s.closers, f)
	s.closeMu.Unlock()
}

// close stops everything, newest first (the tracer, the system, the
// server last). Idempotent.
func (s *system) close() {
	s.closeMu.Lock()
	cs := s.closers
	s.closers = nil
	s.closeMu.Unlock()
	for i := len(cs) - 1; i >= 0; i-- {
		cs[i]()
	}
}

// connect opens a connection of its own to the server.
func (s *system) connect(name string, opts ...nats.Option) *nats.Conn {
	nc, err := s.Connect(name, opts...)
	if err != nil {
		s.tb.Fatal(err)
	}
	return nc
}

// entity is the system's benchlab.SystemConfig.Entity: echo entities
// behind a probe of region id, or as they are (plain).
func (s *system) entity(id string) (natshard.Factory, error) {
	if s.cfg.plain {
		return entities.Echo(), nil
	}
	p := &probe{}
	s.mu.Lock()
	s.regions[id] = &node{probe: p}
	s.mu.Unlock()
	for {
		old := s.probes.Load()
		ps := append(slices.Clone(*old), p)
		if s.probes.CompareAndSwap(old, &ps) {
			break
		}
	}
	return p.factory(entities.Echo()), nil
}

// startRegion starts region id, a node on a connection of its own,
// hosting echo entities behind a probe.
func (s *system) startRegion(id string) *node {
	s.tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := s.StartRegion(ctx, id)
	if err != nil {
		s.tb.Fatal(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.regions[id]
	if n == nil { // plain
		n = &node{}
		s.regions[id] = n
	}
	n.Region = r
	return n
}

func (s *system) region(id string) *node {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.regions[id]
}

// handled is the number of publisher messages handled by every region
// (duplicates included: with Nats-Msg-Id there are none).
func (s *system) handled() int64 {
	var n int64
	for _, p := range *s.probes.Load() {
		n += p.handled.Load()
	}
	return n
}

// resetDelays restarts every probe's longest delay.
func (s *system) resetDelays() {
	for _, p := range *s.probes.Load() {
		p.maxDelay.Store(0)
	}
}

// maxDelay is the longest publish -> Handle delay of every region since
// resetDelays.
func (s *system) maxDelay() time.Duration {
	var d int64
	for _, p := range *s.probes.Load() {
		d = max(d, p.maxDelay.Load())
	}
	return time.Duration(d)
}

// move asks the coordinator to move shard to target.
func (s *system) move(shard int, target string) error {
	return s.Admin(protocol.AdminMove, protocol.MoveRequest{Shard: shard, Region: target})
}

// waitSettled waits until the coordinator reports every shard active on
// the running regions, balanced within one shard, and served live.
func (s *system) waitSettled(timeout time.Duration) {
	s.tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout+time.Second)
	defer cancel()
	if st, err := s.WaitBalanced(ctx, timeout); err != nil {
		s.tb.Fatalf("system not settled after %v: %+v %v", timeout, st, err)
	}
}

// spread summarizes a status: whether every shard is active, and the
// smallest and largest number of shards per live region.
func spread(st protocol.Status) (allActive bool, lo, hi int) {
	allActive = len(st.Table) == st.Shards
	for _, r := range st.Table {
		if r.State != string(protocol.StateActive) {
			allActive = false
		}
	}
	lo = -1
	for _, r := range st.Regions {
		if lo < 0 || r.Shards < lo {
			lo = r.Shards
		}
		hi = max(hi, r.Shards)
	}
	return allActive, lo, hi
}

// owner is the region shard is active on, "" if it is not active.
func (s *system) owner(shard int) string {
	st, err := s.Status()
	if err != nil || shard >= len(st.Table) || st.Table[shard].State != string(protocol.StateActive) {
		return ""
	}
	return st.Table[shard].Region
}

// touch sends one request to each of ids, so that each entity is active
// (benchlab.Touch).
func (s *system) touch(nc *nats.Conn, ids []string) error {
	subjects := make([]string, len(ids))
	for i, id := range ids {
		subjects[i] = s.subjects.EntityOf(id, shardCount)
	}
	return benchlab.Touch(nc, subjects, []byte("r"), 5*time.Second)
}

// idsOfShard returns n entity ids that hash to shard.
func idsOfShard(shard, n int) []string {
	ids := make([]string, 0, n)
	for i := 0; len(ids) < n; i++ {
		id := fmt.Sprintf("e-%d", i)
		if protocol.ShardOf(id, shardCount) == shard {
			ids = append(ids, id)
		}
	}
	return ids
}

// idsAll returns n entity ids, spread over all shards by the hash.
func idsAll(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("e-%d", i)
	}
	return ids
}

// probe wraps a region's entities: it counts the publisher's messages they
// handle, notes the first message of a shard after it was armed and the
// last Stop hook.
type probe struct {
	handled atomic.Int64 // publisher messages ("p" payload) handled

	shard atomic.Int64 // shard whose first message is noted when armed
	armed atomic.Bool
	first atomic.Int64                  // now() of that first Handle
	ch    atomic.Pointer[chan struct{}] // closed at that first Handle

	lastStop atomic.Int64 // now() of the latest Stop hook
	stops    atomic.Int64
	// maxDelay is the longest time a publisher message took from its
	// publication to its Handle since arm or system.resetDelays.
	maxDelay atomic.Int64
}

// arm resets the probe: the returned channel is closed at the next Handle
// of a message of shard.
func (p *probe) arm(shard int) <-chan struct{} {
	ch := make(chan struct{})
	p.shard.Store(int64(shard))
	p.first.Store(0)
	p.ch.Store(&ch)
	p.lastStop.Store(0)
	p.stops.Store(0)
	p.maxDelay.Store(0)
	p.armed.Store(true)
	return ch
}

func (p *probe) disarm() { p.armed.Store(false) }

func (p *probe) factory(inner natshard.Factory) natshard.Factory {
	return func(ctx context.Context, id string) (natshard.Entity, error) {
		e, err := inner(ctx, id)
		if err != nil {
			return nil, err
		}
		return &probed{inner: e, p: p}, nil
	}
}

type probed struct {
	inner natshard.Entity
	p     *probe
}

func (e *probed) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	p := e.p
	if p.armed.Load() && int64(m.Shard) == p.shard.Load() && p.armed.CompareAndSwap(true, false) {
		p.first.Store(int64(now()))
		close(*p.ch.Load())
	}
	if len(m.Data) == 9 && m.Data[0] == 'p' {
		p.handled.Add(1)
		atomicMax(&p.maxDelay, int64(now())-int64(binary.BigEndian.Uint64(m.Data[1:])))
	}
	return e.inner.Handle(ctx, m)
}

func (e *probed) Stop(ctx context.Context) error {
	atomicMax(&e.p.lastStop, int64(now()))
	e.p.stops.Add(1)
	return e.inner.Stop(ctx)
}

func atomicMax(a *atomic.Int64, v int64) {
	for {
		old := a.Load()
		if old >= v || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// publisher sends plain publishes to subjects round-robin at a steady
// rate, each with a unique Nats-Msg-Id (so that the overlap of a handoff
// delivers no duplicate), flow-controlled: it never has more than window
// messages published and not yet handled. A backlog is not caught up:
// time spent waiting for the window is lost, so the rate stays steady.
type publisher struct {
	nc       *nats.Conn
	subjects []string
	rate     float64
	window   int64
	handled  func() int64

	sent     atomic.Int64
	stalled  atomic.Int64 // ticks spent with the window full
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
}

func startPublisher(nc *nats.Conn, subjects []string, rate float64, window int64, handled func() int64) *publisher {
	p := &publisher{nc: nc, subjects: subjects, rate: rate, window: window, handled: handled,
		stop: make(chan struct{}), done: make(chan struct{})}
	go p.run()
	return p
}

func (p *publisher) run() {
	defer close(p.done)
	const tick = time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	last := time.Now()
	credit, maxCredit := 0.0, max(1, p.rate*0.02) // at most a 20 ms burst
	offset := p.handled() - p.sent.Load()         // handled counts of earlier publishers
	var fullSince time.Time
	i := 0
	for {
		select {
		case <-p.stop:
			return
		case at := <-t.C:
			credit = min(maxCredit, credit+p.rate*at.Sub(last).Seconds())
			last = at
		}
		for credit >= 1 {
			out := p.sent.Load() - (p.handled() - offset)
			if out >= p.window {
				p.stalled.Add(1)
				switch {
				case fullSince.IsZero():
					fullSince = time.Now()
				case time.Since(fullSince) > 5*time.Second:
					// Messages lost or refused: stop waiting for them.
					offset = p.handled() - p.sent.Load()
					fullSince = time.Time{}
				}
				break
			}
			fullSince = time.Time{}
			// "p" and the time of publication: the probe counts the
			// message and notes its delay.
			data := make([]byte, 9)
			data[0] = 'p'
			binary.BigEndian.PutUint64(data[1:], uint64(now()))
			m := &nats.Msg{Subject: p.subjects[i%len(p.subjects)], Data: data,
				Header: nats.Header{protocol.HeaderMsgID: []string{nuid.Next()}}}
			i++
			if err := p.nc.PublishMsg(m); err != nil {
				return
			}
			p.sent.Add(1)
			credit--
		}
	}
}

// close stops the publisher; idempotent.
func (p *publisher) close() {
	p.stopOnce.Do(func() { close(p.stop) })
	<-p.done
}

// tracer watches the protocol on the wire without taking part: the
// coordinator's commands to regions, the regions' answers, the shard
// table writes and the end markers. Each event is stamped with now().
type tracer struct {
	mu      sync.Mutex
	events  []event
	pending map[string]protocol.Command // reply subject -> command (probes excluded)
	regions map[string]string           // reply subject -> region
	prefix  string                      // of region command subjects
	quit    chan struct{}
}

type eventKind uint8

const (
	evCommand eventKind = iota + 1 // coordinator -> region
	evReply                        // region -> coordinator
	evWrite                        // shard table row written
	evMarker                       // end marker appended
)

type event struct {
	at       time.Duration
	kind     eventKind
	region   string                // command, reply: the region; write: the owner
	cmd      protocol.CommandKind  // command, reply
	shards   []int                 // command, reply: the command's shards; write, marker: the shard
	state    protocol.ShardState   // write
	source   string                // write
	complete bool                  // reply
	failed   string                // reply: the region's error
	record   *protocol.ShardRecord // write
}

func startTracer(tb testing.TB, nc *nats.Conn, subjects protocol.Subjects) *tracer {
	tb.Helper()
	t := &tracer{pending: map[string]protocol.Command{}, regions: map[string]string{}, prefix: subjects.Region(""), quit: make(chan struct{})}
	subs := map[string]nats.MsgHandler{
		subjects.Region("*"): t.onCommand,
		coordInbox + ".>":    t.onReply,
		"$KV." + kvstate.BucketName(subjects.Type()) + ".shards.*": t.onWrite,
		strings.TrimSuffix(subjects.BufferAll(), "*") + "e":        t.onMarker,
	}
	// One channel for all subscriptions, one goroutine reading it: the
	// events are stamped in the order the server delivered them. (With a
	// callback per subscription, each runs on its own goroutine and a
	// reply could be stamped after the command it caused.)
	ch := make(chan *nats.Msg, 1<<16)
	for subj := range subs {
		if _, err := nc.ChanSubscribe(subj, ch); err != nil {
			tb.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		tb.Fatal(err)
	}
	go func() {
		for {
			select {
			case m := <-ch:
				if h := subs[m.Sub.Subject]; h != nil {
					h(m)
				}
			case <-t.quit:
				return
			}
		}
	}()
	return t
}

func (t *tracer) stop() { close(t.quit) }

// add appends e, stamped now: under the lock, so that the events stay in
// time order (first and since search them).
func (t *tracer) add(e event) {
	t.mu.Lock()
	e.at = now()
	t.events = append(t.events, e)
	t.mu.Unlock()
}

func (t *tracer) onCommand(m *nats.Msg) {
	var cmd protocol.Command
	if protocol.Decode(m.Data, &cmd) != nil || cmd.Kind == protocol.CmdProbe {
		return
	}
	id := strings.TrimPrefix(m.Subject, t.prefix)
	t.mu.Lock()
	if m.Reply != "" {
		t.pending[m.Reply] = cmd
		t.regions[m.Reply] = id
	}
	t.events = append(t.events, event{at: now(), kind: evCommand, region: id, cmd: cmd.Kind, shards: cmd.Shards})
	t.mu.Unlock()
}

func (t *tracer) onReply(m *nats.Msg) {
	t.mu.Lock()
	cmd, ok := t.pending[m.Subject]
	id := t.regions[m.Subject]
	delete(t.pending, m.Subject)
	delete(t.regions, m.Subject)
	t.mu.Unlock()
	if !ok {
		return // a probe's answer, or a JetStream acknowledgement
	}
	var r protocol.Reply
	if protocol.Decode(m.Data, &r) != nil {
		return
	}
	t.add(event{kind: evReply, region: id, cmd: cmd.Kind, shards: cmd.Shards, complete: r.Complete, failed: r.Error})
}

func (t *tracer) onWrite(m *nats.Msg) {
	var rec protocol.ShardRecord
	if len(m.Data) == 0 || protocol.Decode(m.Data, &rec) != nil {
		return
	}
	t.add(event{kind: evWrite, region: rec.Region, shards: []int{rec.Shard}, state: rec.State, source: rec.Source, record: &rec})
}

func (t *tracer) onMarker(m *nats.Msg) {
	// $SHARD.<type>.buf.<n>.e
	toks := strings.Split(m.Subject, ".")
	var n int
	if len(toks) < 2 {
		return
	}
	if _, err := fmt.Sscan(toks[len(toks)-2], &n); err != nil {
		return
	}
	t.add(event{kind: evMarker, shards: []int{n}})
}

// first returns the time of the first event at or after from that
// matches, or -1.
func (t *tracer) first(from time.Duration, match func(e *event) bool) time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	i, _ := slices.BinarySearchFunc(t.events, from, func(e event, at time.Duration) int { return cmp.Compare(e.at, at) })
	for ; i < len(t.events); i++ {
		if match(&t.events[i]) {
			return t.events[i].at
		}
	}
	return -1
}

// since returns a copy of the events at or after from.
func (t *tracer) since(from time.Duration) []event {
	t.mu.Lock()
	defer t.mu.Unlock()
	i, _ := slices.BinarySearchFunc(t.events, from, func(e event, at time.Duration) int { return cmp.Compare(e.at, at) })
	return slices.Clone(t.events[i:])
}

func (e *event) about(shard int) bool { return slices.Contains(e.shards, shard) }
