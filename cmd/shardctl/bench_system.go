package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// benchServer is the NATS server the bench runs on: embedded (one, or a
// cluster of --servers), or the one given with --nats. Each delivery mode
// measured gets a benchSystem of its own on it, one after the other.
type benchServer struct {
	url  string           // the client URLs, comma-separated
	srvs []*server.Server // none with --nats
	dir  string           // the embedded servers' stores
	// sys is the password of the embedded servers' system account user
	// (benchSysUser): the coordinator reads the servers' disconnect
	// advisories with it, as shardd does on its embedded server.
	sys string
}

// benchSysUser is the embedded server's system account user.
const benchSysUser = "shardctl-bench-system"

// openBenchServer starts the embedded servers, unless cfg.NATS names one.
func openBenchServer(cfg benchConfig) (*benchServer, error) {
	if cfg.NATS != "" {
		return &benchServer{url: cfg.NATS}, nil
	}
	dir, err := os.MkdirTemp("", "shardctl-bench-")
	if err != nil {
		return nil, err
	}
	s := &benchServer{dir: dir, sys: nuid.Next()}
	if err := s.start(cfg.Servers); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// close shuts the embedded servers down and removes their stores.
func (s *benchServer) close() {
	for _, srv := range s.srvs {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
}

// start starts n embedded servers with JetStream on random ports of
// 127.0.0.1, each storing in a directory of s.dir, a cluster of their own
// when n > 1, with a system account whose user benchSysUser has password
// s.sys (every other client is in the global account, without
// credentials), and waits until they accept connections and, as a
// cluster, have a JetStream meta leader.
func (s *benchServer) start(n int) error {
	var routes []*url.URL
	var clusterPorts []int
	if n > 1 {
		for range n {
			p, err := freePort()
			if err != nil {
				return err
			}
			clusterPorts = append(clusterPorts, p)
			routes = append(routes, &url.URL{Scheme: "nats-route", Host: "127.0.0.1:" + strconv.Itoa(p)})
		}
	}
	var urls []string
	for i := range n {
		acc := server.NewAccount("SYS")
		opts := &server.Options{
			ServerName: "shardctl-bench-" + strconv.Itoa(i+1), Host: "127.0.0.1", Port: -1,
			JetStream: true, StoreDir: filepath.Join(s.dir, strconv.Itoa(i+1)), NoLog: true, NoSigs: true, DisableJetStreamBanner: true,
			PingInterval: 2 * time.Second, MaxPingsOut: 3,
			Accounts: []*server.Account{acc}, SystemAccount: acc.Name, NoAuthUser: "bench",
			Users: []*server.User{{Username: benchSysUser, Password: s.sys, Account: acc}, {Username: "bench"}},
		}
		if n > 1 {
			opts.Cluster = server.ClusterOpts{Name: "shardctl-bench", Host: "127.0.0.1", Port: clusterPorts[i], PoolSize: -1}
			opts.Routes = routes
		}
		srv, err := server.NewServer(opts)
		if err != nil {
			return fmt.Errorf("embedded NATS server: %w", err)
		}
		srv.Start()
		s.srvs = append(s.srvs, srv)
		if !srv.ReadyForConnections(10 * time.Second) {
			return errors.New("embedded NATS server did not start")
		}
		urls = append(urls, srv.ClientURL())
	}
	s.url = strings.Join(urls, ",")
	if n == 1 {
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, srv := range s.srvs {
			if srv.JetStreamIsLeader() && len(srv.JetStreamClusterPeers()) == n {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the %d embedded NATS servers have no JetStream meta leader after 30 s", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// freePort is a port of 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// benchSystem is what shardctl bench measures: regions hosting echo or kv
// entities of one type and one coordinator, all in this process, each a
// natshard node on a connection of its own, as separate shardd processes
// would be.
type benchSystem struct {
	cfg      benchConfig
	url      string
	sys      string            // the embedded server's system user's password; "" with --nats
	typ      string            // the type's name
	delivery natshard.Delivery // the type's delivery mode
	subjects protocol.Subjects
	log      *slog.Logger
	admin    *nats.Conn
	js       jetstream.JetStream

	// handled counts every message handled by an entity of any region.
	handled recvCounter
	// loadHist, while set, gets the time of each load message from its
	// publish to its handling (bench_loadlat.go).
	loadHist atomic.Pointer[latHist]
	failed   atomic.Int64   // of those, the ones Handle returned an error for
	crashed  sync.WaitGroup // Close of crashed regions' nodes

	mu      sync.Mutex
	regions map[string]*benchRegion
	order   []string // region ids, in start order
	nextID  int

	coordinator *benchCoordinator
	coords      int          // coordinator candidates started
	conns       []*nats.Conn // every connection opened, closed by close
	created     bool         // the type was created: close deletes it from a --nats server
}

// benchCoordinator is a coordinator candidate: a node without region, on
// connections of its own.
type benchCoordinator struct {
	node  *natshard.Node
	conns []*nats.Conn
}

// benchRegion is one region of the system.
type benchRegion struct {
	id    string
	nc    *nats.Conn
	node  *natshard.Node
	probe *benchProbe
}

// clock0 is the origin of the probes' timestamps.
var clock0 = time.Now()

func since0() int64 { return int64(time.Since(clock0)) }

// benchProbe notes the first message of one shard that a region handles
// once armed: the new owner's first message in a handoff.
type benchProbe struct {
	armed atomic.Bool
	shard atomic.Int64
	first atomic.Int64 // since0() of that message
	ch    atomic.Pointer[chan struct{}]
}

func (p *benchProbe) arm(shard int) <-chan struct{} {
	ch := make(chan struct{})
	p.shard.Store(int64(shard))
	p.ch.Store(&ch)
	p.armed.Store(true)
	return ch
}

// probed wraps an entity: it counts what it handles and feeds the probe.
type probed struct {
	inner natshard.Entity
	sys   *benchSystem
	probe *benchProbe
}

func (e *probed) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	data, err := e.inner.Handle(ctx, m)
	if err != nil {
		e.sys.failed.Add(1)
	}
	e.sys.noteLoad(m)
	e.sys.handled.add()
	if p := e.probe; p.armed.Load() && int64(m.Shard) == p.shard.Load() && p.armed.CompareAndSwap(true, false) {
		p.first.Store(since0())
		close(*p.ch.Load())
	}
	return data, err
}

func (e *probed) Stop(ctx context.Context) error { return e.inner.Stop(ctx) }

// startBenchSystem creates the type typ of the given delivery on srv,
// starts cfg.Regions regions and a coordinator, and waits until every
// shard is active and served live.
func startBenchSystem(ctx context.Context, cfg benchConfig, srv *benchServer, typ string, delivery natshard.Delivery) (s *benchSystem, err error) {
	s = &benchSystem{cfg: cfg, url: srv.url, sys: srv.sys, typ: typ, delivery: delivery, regions: map[string]*benchRegion{}, log: slog.New(slog.DiscardHandler)}
	defer func() {
		if err != nil {
			s.close()
			s = nil
		}
	}()
	if s.subjects, err = protocol.NewSubjects(cfg.DataPrefix, cfg.ControlPrefix, typ); err != nil {
		return s, fmt.Errorf("%w: %w", errUsage, err)
	}
	if s.admin, err = s.connect("admin"); err != nil {
		return s, err
	}
	if s.js, err = jetstream.New(s.admin); err != nil {
		return s, err
	}
	if cfg.NATS != "" {
		// Never touch a type that exists: the bench deletes what it made.
		if _, err := s.js.KeyValue(ctx, kvstate.BucketName(typ)); err == nil {
			return s, fmt.Errorf("%w: type %q exists on %s already; pass another --type", errUsage, typ, s.url)
		}
	}
	if _, err := kvstate.Open(ctx, s.js, typ, kvstate.Options{Replicas: cfg.replicas()}); err != nil {
		return s, fmt.Errorf("open the bench type %q: %w", typ, err)
	}
	s.created = true
	for range cfg.Regions {
		if _, err := s.startRegion(ctx); err != nil {
			return s, err
		}
	}
	if err := s.startCoordinator(ctx); err != nil {
		return s, err
	}
	if _, err := s.waitBalanced(ctx, 60*time.Second); err != nil {
		return s, err
	}
	return s, nil
}

// connect opens a connection with shardd's options.
func (s *benchSystem) connect(name string, extra ...nats.Option) (*nats.Conn, error) {
	nc, err := nats.Connect(s.url, append([]nats.Option{nats.Name("shardctl-bench-" + name), nats.PingInterval(2 * time.Second),
		nats.MaxPingsOutstanding(2), nats.MaxReconnects(0), nats.Timeout(s.cfg.Timeout)}, extra...)...)
	if err != nil {
		return nil, fmt.Errorf("cannot connect to NATS at %s: %w", s.url, err)
	}
	s.mu.Lock()
	s.conns = append(s.conns, nc)
	s.mu.Unlock()
	return nc, nil
}

// benchType is the bench's entity type, with entities made by entity:
// never rebalanced but when asked (waitBalanced asks).
func (s *benchSystem) benchType(entity natshard.Factory) natshard.Type {
	return natshard.Type{
		Name: s.typ, Kind: s.cfg.Kind, Entity: entity, Shards: s.cfg.Shards, Delivery: s.delivery,
		MinRegions: s.cfg.Regions, RebalanceInterval: natshard.Off, Replicas: s.cfg.replicas(),
	}
}

// startNode starts a natshard node of the bench type on nc.
func (s *benchSystem) startNode(ctx context.Context, nc *nats.Conn, opts natshard.Options, entity natshard.Factory) (*natshard.Node, error) {
	opts.Conn, opts.Logger = nc, s.log
	opts.DataPrefix, opts.ControlPrefix = s.cfg.DataPrefix, s.cfg.ControlPrefix
	return natshard.Start(ctx, opts, s.benchType(entity))
}

// startRegion starts a new region (r1, r2, ...), a node of its own.
func (s *benchSystem) startRegion(ctx context.Context) (*benchRegion, error) {
	s.mu.Lock()
	s.nextID++
	id := "r" + strconv.Itoa(s.nextID)
	s.mu.Unlock()
	nc, err := s.connect("region-" + id)
	if err != nil {
		return nil, err
	}
	inner, err := entities.Kind(s.cfg.Kind, "")
	if err != nil {
		return nil, err
	}
	r := &benchRegion{id: id, nc: nc, probe: &benchProbe{}}
	factory := func(ctx context.Context, eid string) (natshard.Entity, error) {
		e, err := inner(ctx, eid)
		if err != nil {
			return nil, err
		}
		return &probed{inner: e, sys: s, probe: r.probe}, nil
	}
	r.node, err = s.startNode(ctx, nc, natshard.Options{Region: id, NoCoordinator: true}, factory)
	if err != nil {
		return nil, fmt.Errorf("region %s: %w", id, err)
	}
	s.mu.Lock()
	s.regions[id] = r
	s.order = append(s.order, id)
	s.mu.Unlock()
	return r, nil
}

// crash kills region id as kill -9 would: its connection closes at once
// (the server drops its subscriptions), nothing is handed off.
func (s *benchSystem) crash(id string) {
	s.mu.Lock()
	r := s.regions[id]
	delete(s.regions, id)
	s.order = slices.DeleteFunc(s.order, func(x string) bool { return x == id })
	s.mu.Unlock()
	r.nc.Close()
	s.crashed.Go(func() {
		// Its goroutines and stop hooks; the deregistration fails, as
		// after a crash.
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.node.Close(cctx)
	})
}

func (s *benchSystem) regionIDs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.order)
}

func (s *benchSystem) region(id string) *benchRegion {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.regions[id]
}

// startCoordinator starts a coordinator candidate, a node that hosts no region,
// on a connection of its own.
func (s *benchSystem) startCoordinator(ctx context.Context) error {
	s.coords++
	name := "coordinator-" + strconv.Itoa(s.coords)
	nc, err := s.connect(name)
	if err != nil {
		return err
	}
	c := &benchCoordinator{conns: []*nats.Conn{nc}}
	opts := natshard.Options{Region: "bench-" + name, NoRegion: true}
	if s.sys != "" {
		if opts.SystemConn, err = s.connect(name+"-system", nats.UserInfo(benchSysUser, s.sys)); err != nil {
			return err
		}
		c.conns = append(c.conns, opts.SystemConn)
	}
	s.coordinator = c
	if c.node, err = s.startNode(ctx, nc, opts, nil); err != nil {
		return fmt.Errorf("coordinator: %w", err)
	}
	return nil
}

// crashCoordinator starts a standby candidate, kills the leading
// coordinator's node as kill -9 would (its connections close at once) and
// returns how long until the standby answers as the coordinator of a
// newer epoch. The standby is the coordinator from then on.
func (s *benchSystem) crashCoordinator(ctx context.Context) (time.Duration, error) {
	old := s.coordinator
	before, err := s.status()
	if err != nil {
		return 0, err
	}
	if err := s.startCoordinator(ctx); err != nil { // the standby: s.coordinator from now on
		return 0, err
	}
	// As in a deployment, the standby is waiting for the lease when the
	// holder dies: it has read who holds it, so the server's report of the
	// holder's closed connection means something to it.
	if !wait.Sleep(ctx, time.Second) {
		return 0, ctx.Err()
	}
	t0 := time.Now()
	for _, nc := range old.conns {
		nc.Close()
	}
	// A status request every 2 ms, each waiting up to a second without
	// holding up the next: one sent as the connections close may reach
	// the dead coordinator, and the new one answers what reached it
	// before it was ready only when it is. The first answer of a newer
	// epoch is the time.
	answered := make(chan time.Duration, 1)
	var polls sync.WaitGroup
	defer polls.Wait()
	poll := time.NewTicker(2 * time.Millisecond)
	defer poll.Stop()
	for {
		select {
		case d := <-answered:
			s.crashed.Go(func() { _ = old.node.Close(context.Background()) })
			return d, nil
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-poll.C:
			if time.Since(t0) > 60*time.Second {
				return 0, errors.New("no new coordinator 60 s after the coordinator's crash")
			}
			polls.Go(func() {
				st, err := s.statusWithin(time.Second)
				if err == nil && st.Coordinator.Epoch > before.Coordinator.Epoch {
					select {
					case answered <- time.Since(t0):
					default:
					}
				}
			})
		}
	}
}

// close stops the nodes and, on a server given with --nats, deletes the
// type's bucket and streams. The server stays (benchServer.close).
func (s *benchSystem) close() {
	for _, id := range s.regionIDs() {
		r := s.region(id)
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = r.node.Close(cctx)
		cancel()
	}
	s.crashed.Wait()
	if s.coordinator != nil && s.coordinator.node != nil {
		_ = s.coordinator.node.Close(context.Background())
	}
	if s.cfg.NATS != "" && s.created {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		_ = s.js.DeleteKeyValue(ctx, kvstate.BucketName(s.typ))
		_ = s.js.DeleteStream(ctx, kvstate.BufferStream(s.typ))
		if s.delivery == natshard.Durable {
			_ = s.js.DeleteStream(ctx, kvstate.MessageStream(s.typ))
			_ = s.js.DeleteStream(ctx, kvstate.ReminderStream(s.typ))
		}
		cancel()
	}
	s.mu.Lock()
	conns := s.conns
	s.conns = nil
	s.mu.Unlock()
	for _, nc := range conns {
		nc.Close()
	}
}

// status asks the coordinator for its status.
func (s *benchSystem) status() (protocol.Status, error) { return s.statusWithin(s.cfg.Timeout) }

// statusWithin is status with a timeout of its own.
func (s *benchSystem) statusWithin(timeout time.Duration) (protocol.Status, error) {
	var st protocol.Status
	m, err := s.admin.Request(s.subjects.Admin(protocol.AdminStatus), nil, timeout)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(m.Data, &st)
}

// admin sends an admin request and returns the coordinator's error, if any.
func (s *benchSystem) adminRequest(verb string, body any) error {
	data, _ := json.Marshal(body)
	m, err := s.admin.Request(s.subjects.Admin(verb), data, s.cfg.Timeout)
	if err != nil {
		return fmt.Errorf("admin %s: %w", verb, err)
	}
	var ae protocol.AdminError
	if json.Unmarshal(m.Data, &ae) == nil && ae.Error != "" {
		return fmt.Errorf("admin %s: %s", verb, ae.Error)
	}
	return nil
}

// owners maps each region to the shards it has active, from a status.
func owners(st protocol.Status) map[string][]int {
	out := map[string][]int{}
	for _, r := range st.Table {
		if r.State == string(protocol.StateActive) {
			out[r.Region] = append(out[r.Region], r.Shard)
		}
	}
	return out
}

// waitBalanced waits until every shard is active, the running regions
// hold them within one shard of each other (asking for rebalance rounds
// while they do not) and every region serves its shards live.
func (s *benchSystem) waitBalanced(ctx context.Context, timeout time.Duration) (protocol.Status, error) {
	deadline := time.Now().Add(timeout)
	var lastRound time.Time
	for {
		st, err := s.status()
		ids := s.regionIDs()
		if err == nil && len(st.Table) == s.cfg.Shards && len(st.Regions) == len(ids) {
			own := owners(st)
			n := 0
			lo, hi := s.cfg.Shards, 0
			for _, id := range ids {
				n += len(own[id])
				lo, hi = min(lo, len(own[id])), max(hi, len(own[id]))
			}
			if n == s.cfg.Shards && hi-lo <= 1 && s.allLive(ids) {
				return st, nil
			}
			if n == s.cfg.Shards && hi-lo > 1 && time.Since(lastRound) > 200*time.Millisecond {
				_ = s.adminRequest(protocol.AdminRebalance, protocol.RebalanceRequest{})
				lastRound = time.Now()
			}
		}
		if time.Now().After(deadline) {
			return st, fmt.Errorf("the bench system did not settle in %v (last status error: %v)", timeout, err)
		}
		select {
		case <-ctx.Done():
			return st, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// allLive reports whether each region serves every shard it holds live
// (the table says active once the end marker is written; the region goes
// live when its replay reaches it).
func (s *benchSystem) allLive(ids []string) bool {
	for _, id := range ids {
		var ans protocol.QueryAnswer
		m, err := s.admin.Request(s.subjects.Query(id), nil, s.cfg.Timeout)
		if err != nil || json.Unmarshal(m.Data, &ans) != nil {
			return false
		}
		for _, r := range ans.Shards {
			if r.Mode != "live" {
				return false
			}
		}
	}
	return true
}
