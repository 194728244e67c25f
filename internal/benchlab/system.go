package benchlab

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// SystemConfig is the type a System hosts and how its nodes run.
type SystemConfig struct {
	Type     string
	Kind     string // the type's Kind
	Delivery natshard.Delivery
	Shards   int
	Replicas int // of the type's bucket and streams; 0: 1
	// MinRegions and RebalanceInterval are the type's. With
	// RebalanceInterval natshard.Off, WaitBalanced asks for the rebalance
	// rounds it needs.
	MinRegions        int
	RebalanceInterval time.Duration
	// ReleaseGrace is every node's (Options.ReleaseGrace; 0: natshard's
	// default).
	ReleaseGrace  time.Duration
	DataPrefix    string
	ControlPrefix string
	// Timeout bounds each connection attempt and admin request; 0: 5 s.
	Timeout time.Duration
	// Logger is every node's; nil: none.
	Logger *slog.Logger
	// Entity makes the entity factory of region id's node.
	Entity func(region string) (natshard.Factory, error)
	// CoordinatorInbox is the inbox prefix of the coordinators'
	// connections ("": nats.go's): a tracer subscribed to it sees the
	// regions' answers to the coordinator's commands.
	CoordinatorInbox string
	// Exclusive: the server is not the harness's. NewSystem refuses a
	// type that exists on it already, and Close deletes the type's bucket
	// and streams.
	Exclusive bool
}

// System is what the benchmarks measure: regions hosting the entities of
// one type and coordinator candidates, all in this process, each a
// natshard node on a connection of its own, as separate shardd processes
// would be. Its methods are safe for concurrent use, except Close.
type System struct {
	cfg      SystemConfig
	url      string
	sys      string // the embedded server's system user's password; "" on a server given
	subjects protocol.Subjects
	admin    *nats.Conn
	js       jetstream.JetStream
	crashed  sync.WaitGroup // Close of crashed regions' and coordinators' nodes

	mu      sync.Mutex
	regions map[string]*Region
	order   []string // region ids, in start order
	nextID  int

	coordinator *coordinator // the latest candidate started
	coords      int          // coordinator candidates started
	conns       []*nats.Conn // every connection opened, closed by Close
	created     bool         // the type was created: Close deletes it when Exclusive
}

// coordinator is a coordinator candidate: a node without region, on
// connections of its own.
type coordinator struct {
	node  *natshard.Node
	conns []*nats.Conn
}

// Region is one region of a System.
type Region struct {
	ID   string
	Conn *nats.Conn
	Node *natshard.Node
}

// NewSystem connects to srv and creates the type of cfg, with neither
// region nor coordinator yet (StartRegion, StartCoordinator). An error of
// the configuration (a bad type name or prefix, an exclusive type that
// exists) wraps ErrUsage.
func NewSystem(ctx context.Context, srv *Server, cfg SystemConfig) (s *System, err error) {
	cfg.Timeout = cmp.Or(cfg.Timeout, 5*time.Second)
	cfg.Replicas = cmp.Or(cfg.Replicas, 1)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s = &System{cfg: cfg, url: srv.url, sys: srv.sys, regions: map[string]*Region{}}
	defer func() {
		if err != nil {
			s.Close()
			s = nil
		}
	}()
	if s.subjects, err = protocol.NewSubjects(cfg.DataPrefix, cfg.ControlPrefix, cfg.Type); err != nil {
		return s, fmt.Errorf("%w: %w", ErrUsage, err)
	}
	if s.admin, err = s.Connect("admin"); err != nil {
		return s, err
	}
	if s.js, err = jetstream.New(s.admin); err != nil {
		return s, err
	}
	if cfg.Exclusive {
		// Never touch a type that exists: the bench deletes what it made.
		if _, err := s.js.KeyValue(ctx, kvstate.BucketName(cfg.Type)); err == nil {
			return s, fmt.Errorf("%w: type %q exists on %s already; pass another --type", ErrUsage, cfg.Type, s.url)
		}
	}
	if _, err := kvstate.Open(ctx, s.js, cfg.Type, kvstate.Options{Replicas: cfg.Replicas}); err != nil {
		return s, fmt.Errorf("open the bench type %q: %w", cfg.Type, err)
	}
	s.created = true
	return s, nil
}

// Subjects are the subjects of the system's type.
func (s *System) Subjects() protocol.Subjects { return s.subjects }

// Connect opens a connection with shardd's options, closed by Close.
func (s *System) Connect(name string, extra ...nats.Option) (*nats.Conn, error) {
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

// natshardType is the system's type, with entities made by entity.
func (s *System) natshardType(entity natshard.Factory) natshard.Type {
	c := s.cfg
	return natshard.Type{
		Name: c.Type, Kind: c.Kind, Entity: entity, Shards: c.Shards, Delivery: c.Delivery,
		MinRegions: c.MinRegions, RebalanceInterval: c.RebalanceInterval, Replicas: c.Replicas,
	}
}

// startNode starts a natshard node of the system's type on nc.
func (s *System) startNode(ctx context.Context, nc *nats.Conn, opts natshard.Options, entity natshard.Factory) (*natshard.Node, error) {
	opts.Conn, opts.Logger, opts.ReleaseGrace = nc, s.cfg.Logger, s.cfg.ReleaseGrace
	opts.DataPrefix, opts.ControlPrefix = s.cfg.DataPrefix, s.cfg.ControlPrefix
	return natshard.Start(ctx, opts, s.natshardType(entity))
}

// StartRegion starts region id ("": r1, r2, ... in start order), a node
// of its own hosting the entities of cfg.Entity.
func (s *System) StartRegion(ctx context.Context, id string) (*Region, error) {
	s.mu.Lock()
	if id == "" {
		s.nextID++
		id = "r" + strconv.Itoa(s.nextID)
	}
	s.mu.Unlock()
	nc, err := s.Connect("region-" + id)
	if err != nil {
		return nil, err
	}
	factory, err := s.cfg.Entity(id)
	if err != nil {
		return nil, err
	}
	r := &Region{ID: id, Conn: nc}
	r.Node, err = s.startNode(ctx, nc, natshard.Options{Region: id, NoCoordinator: true}, factory)
	if err != nil {
		return nil, fmt.Errorf("region %s: %w", id, err)
	}
	s.mu.Lock()
	s.regions[id] = r
	s.order = append(s.order, id)
	s.mu.Unlock()
	return r, nil
}

// Crash kills region id as kill -9 would: its connection closes at once
// (the server drops its subscriptions), nothing is handed off.
func (s *System) Crash(id string) {
	s.mu.Lock()
	r := s.regions[id]
	delete(s.regions, id)
	s.order = slices.DeleteFunc(s.order, func(x string) bool { return x == id })
	s.mu.Unlock()
	r.Conn.Close()
	s.crashed.Go(func() {
		// Its goroutines and stop hooks; the deregistration fails, as
		// after a crash.
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.Node.Close(cctx)
	})
}

// RegionIDs are the running regions, in start order.
func (s *System) RegionIDs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.order)
}

// Region is running region id, nil if there is none.
func (s *System) Region(id string) *Region {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.regions[id]
}

// StartCoordinator starts a coordinator candidate, a node that hosts no
// region, on a connection of its own (and, on embedded servers, one of the
// system account, from which it reads the servers' disconnect advisories
// as shardd does).
func (s *System) StartCoordinator(ctx context.Context) error {
	s.mu.Lock()
	s.coords++
	name := "coordinator-" + strconv.Itoa(s.coords)
	s.mu.Unlock()
	var opts []nats.Option
	if s.cfg.CoordinatorInbox != "" {
		opts = append(opts, nats.CustomInboxPrefix(s.cfg.CoordinatorInbox))
	}
	nc, err := s.Connect(name, opts...)
	if err != nil {
		return err
	}
	c := &coordinator{conns: []*nats.Conn{nc}}
	nopts := natshard.Options{Region: "bench-" + name, NoRegion: true}
	if s.sys != "" {
		if nopts.SystemConn, err = s.Connect(name+"-system", nats.UserInfo(benchSysUser, s.sys)); err != nil {
			return err
		}
		c.conns = append(c.conns, nopts.SystemConn)
	}
	s.mu.Lock()
	s.coordinator = c
	s.mu.Unlock()
	if c.node, err = s.startNode(ctx, nc, nopts, nil); err != nil {
		return fmt.Errorf("coordinator: %w", err)
	}
	return nil
}

// CrashCoordinator starts a standby candidate, kills the leading
// coordinator's node as kill -9 would (its connections close at once) and
// returns how long until the standby answers as the coordinator of a
// newer epoch. The standby is the coordinator from then on.
func (s *System) CrashCoordinator(ctx context.Context) (time.Duration, error) {
	s.mu.Lock()
	old := s.coordinator
	s.mu.Unlock()
	before, err := s.Status()
	if err != nil {
		return 0, err
	}
	if err := s.StartCoordinator(ctx); err != nil { // the standby: s.coordinator from now on
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

// Close stops the nodes, regions first, and, when Exclusive, deletes the
// type's bucket and streams. The server stays (Server.Close).
func (s *System) Close() {
	for _, id := range s.RegionIDs() {
		r := s.Region(id)
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = r.Node.Close(cctx)
		cancel()
	}
	s.crashed.Wait()
	if c := s.coordinator; c != nil && c.node != nil {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = c.node.Close(cctx)
		cancel()
	}
	if s.cfg.Exclusive && s.created {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		_ = s.js.DeleteKeyValue(ctx, kvstate.BucketName(s.cfg.Type))
		_ = s.js.DeleteStream(ctx, kvstate.BufferStream(s.cfg.Type))
		if s.cfg.Delivery == natshard.Durable {
			for _, name := range kvstate.AllMessageStreams(s.cfg.Type) {
				_ = s.js.DeleteStream(ctx, name)
			}
			_ = s.js.DeleteStream(ctx, kvstate.ReminderStream(s.cfg.Type))
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

// Status asks the coordinator for its status.
func (s *System) Status() (protocol.Status, error) { return s.statusWithin(s.cfg.Timeout) }

// statusWithin is Status with a timeout of its own.
func (s *System) statusWithin(timeout time.Duration) (protocol.Status, error) {
	var st protocol.Status
	m, err := s.admin.Request(s.subjects.Admin(protocol.AdminStatus), nil, timeout)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(m.Data, &st)
}

// Admin sends the coordinator an admin request (protocol.AdminMove, ...)
// and returns its error, if any.
func (s *System) Admin(verb string, body any) error {
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

// WaitBalanced waits until every shard is active, the running regions are
// the coordinator's live regions and hold the shards within one shard of
// each other, and every region serves its shards live. With the type's
// RebalanceInterval natshard.Off it asks for rebalance rounds while the
// regions are not balanced.
func (s *System) WaitBalanced(ctx context.Context, timeout time.Duration) (protocol.Status, error) {
	deadline := time.Now().Add(timeout)
	var lastRound time.Time
	for {
		st, err := s.Status()
		ids := s.RegionIDs()
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
			if s.cfg.RebalanceInterval == natshard.Off && n == s.cfg.Shards && hi-lo > 1 && time.Since(lastRound) > 200*time.Millisecond {
				_ = s.Admin(protocol.AdminRebalance, protocol.RebalanceRequest{})
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
func (s *System) allLive(ids []string) bool {
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
