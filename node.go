package natshard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
	"github.com/natshard/natshard/strategies"
	"go.opentelemetry.io/otel/trace"
)

// Node hosts entity types in this process: for each type, a region that
// serves the shards the type's coordinator gives it, and a coordinator
// candidate. Start one with Start (or Run), stop it with Stop (graceful:
// its shards move to the other processes first) or Close (fast).
//
// A Node applies every safety rule of natshard: it serves no shard from
// the moment its connection drops until, reconnected, it has renewed its
// registration and read which shards are still its own (so that a
// reconnection cannot bring back shards the coordinator gave to another
// process meanwhile),
// chooses lease TTLs and the handoff grace from the servers it reaches,
// refuses to join a type whose stored shard count, strategy or kind it
// disagrees with, refuses a region id that another live process serves,
// and stops in the order that loses nothing.
type Node struct {
	opts     Options // with defaults; LeaseTTL and ReleaseGrace resolved
	log      *slog.Logger
	srv      *server.Server // the embedded server, or nil
	nc       *nats.Conn
	ownsConn bool
	js       jetstream.JetStream
	client   *Client
	metrics  *metrics     // nil without Options.Metrics
	tracer   trace.Tracer // nil without Options.TracerProvider
	started  time.Time    // when Start returned (Ready's ReadyAfter counts from it)
	// startDeadline: Start waits for JetStream until then (StartTimeout).
	startDeadline time.Time

	status    chan nats.Status // the connection's, watched by watchConn
	watchDone chan struct{}

	sys        *nats.Conn // on the system account, or nil
	ownsSys    bool
	disconnect coordinator.Disconnects // the servers' advisories, read on sys; nil without

	mu    sync.Mutex // guards types
	types []*hosted

	stopping chan struct{} // closed when Stop or Close begins
	stopOnce sync.Once
	stopped  chan struct{} // closed when Stop or Close returned

	done     chan struct{} // see Done
	doneOnce sync.Once
	failErr  error
}

// hosted is one type of a node.
type hosted struct {
	t        Type // as applied: stored values and defaults filled in
	node     *Node
	log      *slog.Logger
	subjects protocol.Subjects
	store    *kvstate.Store
	buffer   *kvstate.Buffer
	stream   *kvstate.Stream // durable delivery; nil in core
	agent    *region.Agent
	daemon   *daemonHost // a Daemon's type; nil for others
	// config is the type's stored configuration when the node started
	// hosting it (its counts: the region follows the splits after).
	config protocol.TypeConfig
	tracer trace.Tracer // the node's
	// coordStats counts the coordinator candidate's decisions; nil without one.
	coordStats *coordinator.Stats
	// settled: Ready found the region taken in by a coordinator and done
	// replaying once; it stays ready (see health.go).
	settled atomic.Bool

	stopCoordinator context.CancelFunc
	coordinatorDone chan struct{}
}

// Start connects to NATS (see Options) and hosts the given types there,
// each with its region and, unless Options.NoCoordinator, a coordinator
// candidate. It returns once every type's region is registered; the
// coordinator allocates shards to it from then on. ctx bounds the start
// only.
//
// While JetStream is only unavailable (a cluster forming or electing its
// meta leader, a server starting), Start waits for it, logging what it
// waits for every few seconds and telling Options.OnStartWait, for at most
// Options.StartTimeout; then it fails with ErrStartTimeout.
//
// Start refuses, with an error that names both sides, a type whose stored
// shard count, strategy or kind disagrees with the Type's, and a region id
// that another live process serves.
func Start(ctx context.Context, opts Options, types ...Type) (*Node, error) {
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, fmt.Errorf("natshard: %w", err)
	}
	if len(types) == 0 {
		return nil, errors.New("natshard: no type to host")
	}
	// validate canonicalises: the caller's slice is left alone (nodes
	// started at once with one slice, as natshardtest's, would race).
	types = slices.Clone(types)
	seen := map[string]bool{}
	for i := range types {
		if err := types[i].validate(); err != nil {
			return nil, fmt.Errorf("natshard: %w", err)
		}
		if types[i].Entity == nil && !opts.NoRegion {
			return nil, fmt.Errorf("natshard: type %q: Entity: the factory is required", types[i].Name)
		}
		if seen[types[i].Name] {
			return nil, fmt.Errorf("natshard: type %q given twice", types[i].Name)
		}
		seen[types[i].Name] = true
	}
	n := &Node{
		opts:          opts,
		log:           opts.Logger,
		startDeadline: time.Now().Add(opts.StartTimeout),
		watchDone:     make(chan struct{}),
		stopping:      make(chan struct{}),
		stopped:       make(chan struct{}),
		done:          make(chan struct{}),
	}
	if opts.TracerProvider != nil {
		n.tracer = opts.TracerProvider.Tracer(tracerName)
	}
	if opts.Metrics != nil {
		m, err := newMetrics(n, opts.Metrics)
		if err != nil {
			return nil, fmt.Errorf("natshard: Metrics: register the node's collectors: %w", err)
		}
		n.metrics = m
	}
	if err := n.connect(); err != nil {
		n.unregisterMetrics()
		return nil, err
	}
	cluster := n.nc.ConnectedClusterName()
	n.opts.LeaseTTL = leaseTTL(opts.LeaseTTL, cluster)
	n.opts.ReleaseGrace = releaseGrace(opts.ReleaseGrace, cluster)
	n.log.Info("natshard node connected", "region", opts.Region, "url", n.nc.ConnectedUrl(), "cluster", cluster,
		"lease_ttl", n.opts.LeaseTTL.String(), "release_grace", max(n.opts.ReleaseGrace, 0).String())
	n.client = NewClient(n.nc, WithPrefix(opts.DataPrefix))
	for _, t := range types {
		if err := n.host(ctx, t); err != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
			_ = n.Close(cctx)
			cancel()
			return nil, err
		}
	}
	n.started = time.Now()
	return n, nil
}

// Run starts a node (see Start), serves until ctx ends or the node fails
// (Done), then stops it gracefully (Stop), giving the leave LeaveTimeout.
// It returns Start's error, or why the node failed, or nil.
func Run(ctx context.Context, opts Options, types ...Type) error {
	n, err := Start(ctx, opts, types...)
	if err != nil {
		return err
	}
	return n.Serve(ctx)
}

// Serve serves until ctx ends or the node fails (Done), then stops it
// gracefully (Stop), giving the leave LeaveTimeout. It returns why the
// node failed, or nil. Run is Start, then Serve; call them apart to use
// the node meanwhile (shardd hands it to its HTTP listener).
func (n *Node) Serve(ctx context.Context) error {
	select {
	case <-ctx.Done():
	case <-n.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), LeaveTimeout)
	defer cancel()
	if err := n.Stop(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		n.log.Warn("natshard: stop", "err", err)
	}
	return n.Err()
}

// connect makes n's connection: Options.Conn, or a new one to
// Options.NATS or to an embedded server. It starts watching its status.
func (n *Node) connect() error {
	o := &n.opts
	if o.Conn != nil {
		n.nc, n.sys = o.Conn, o.SystemConn
		if n.nc.Opts.PingInterval > 5*time.Second || n.nc.Opts.MaxReconnect >= 0 {
			n.log.Warn("Options.Conn was not connected with natshard.ConnectOptions: it may notice a dead server late, or give up reconnecting (the node then stops)",
				"ping_interval", n.nc.Opts.PingInterval.String(), "max_reconnects", n.nc.Opts.MaxReconnect)
		}
	} else {
		url, client := o.NATS, o.auth()
		var extra []nats.Option
		var sys *sysUser
		if url == "" {
			srv, su, err := startServer(o.Server, o.Region, n.log)
			if err != nil {
				return fmt.Errorf("natshard: %w", err)
			}
			n.srv, sys = srv, su
			url = srv.ClientURL()
			n.log.Info("embedded NATS server started", "url", url, "data_dir", o.Server.DataDir,
				"operator_mode", o.Server.AuthDir != "", "tls", o.Server.TLS.Cert != "")
			if o.Server.clustered() {
				// The node's connection learns the other members' client
				// URLs from the cluster (nats.go's discovered servers);
				// its own server only dies with this process.
				members := clusterSize(o.Server)
				n.log.Info("embedded NATS server is a cluster member", "name", srv.Name(), "cluster", srv.ClusterName(),
					"cluster_listen", o.Server.Cluster, "routes", strings.Join(o.Server.Routes, ","), "members", members)
				if members < 3 {
					n.log.Warn("an embedded cluster of fewer than three members stops when any one is lost (JetStream needs a majority): list three in Server.Routes (shardd --routes)", "members", members)
				}
			}
			// The TLS files are the server's; the node connects in
			// process, where the server offers TLS without requiring it.
			client = auth.Client{Creds: o.Creds}
			if o.Server.TLS.Cert != "" {
				extra = append(extra, nats.InProcessServer(srv))
				url = strings.Replace(url, "tls://", "nats://", 1)
			}
		}
		authOpts, err := client.Options()
		if err != nil {
			n.shutdownServer()
			return fmt.Errorf("natshard: %w", err)
		}
		nc, err := nats.Connect(url, append(append(append(authOpts, extra...), ConnectOptions()...),
			nats.Name(o.Name),
			nats.RetryOnFailedConnect(false),
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
				if err != nil { // nil: our own drain or close
					n.log.Warn("disconnected from NATS", "err", err)
				}
			}),
			// Asynchronous errors, permission violations among them.
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { n.log.Warn("NATS error", "err", err) }),
		)...)
		if err != nil {
			n.shutdownServer()
			return fmt.Errorf("natshard: cannot connect to NATS at %s: %w", url, err)
		}
		n.nc, n.ownsConn = nc, true
		if err := n.connectSystem(url, sys, extra); err != nil {
			n.closeConn()
			n.shutdownServer()
			return err
		}
	}
	if n.sys != nil {
		n.disconnect = coordinator.DisconnectAdvisories(n.sys)
	}
	js, err := jetstream.New(n.nc)
	if err != nil {
		n.closeConn()
		n.shutdownServer()
		return fmt.Errorf("natshard: %w", err)
	}
	n.js = js
	n.status = n.nc.StatusChanged(nats.RECONNECTING, nats.CONNECTED, nats.CLOSED)
	go n.watchConn()
	return nil
}

// connectSystem connects to the system account, where the servers publish
// their disconnect advisories: to the embedded server with its system user
// (in process), or to url with Options.SystemCreds; not at all otherwise.
func (n *Node) connectSystem(url string, su *sysUser, extra []nats.Option) error {
	o := &n.opts
	var opts []nats.Option
	switch {
	case o.SystemConn != nil:
		n.sys = o.SystemConn
		return nil
	case su != nil:
		opts = []nats.Option{nats.UserInfo(su.name, su.password), nats.InProcessServer(n.srv)}
	case o.SystemCreds != "":
		c := o.auth()
		c.Creds = o.SystemCreds
		var err error
		if opts, err = c.Options(); err != nil {
			return fmt.Errorf("natshard: SystemCreds: %w", err)
		}
		opts = append(opts, extra...)
	default:
		return nil
	}
	sys, err := nats.Connect(url, append(append(opts, ConnectOptions()...), nats.Name(o.Name+" (system)"))...)
	if err != nil {
		return fmt.Errorf("natshard: cannot connect to the system account of NATS at %s: %w", url, err)
	}
	n.sys, n.ownsSys = sys, true
	return nil
}

// watchConn suspends every region when the connection drops: nats.go
// subscribes again on reconnect, and the coordinator may have moved a
// shard meanwhile, so a region serves nothing (it holds what arrives)
// until it has confirmed its shards once reconnected (region.Agent.Suspend).
// A closed connection ends the node.
func (n *Node) watchConn() {
	defer close(n.watchDone)
	for st := range n.status {
		switch st {
		case nats.RECONNECTING:
			n.eachAgent(func(a *region.Agent) { a.Suspend("disconnected from NATS") })
		case nats.CONNECTED:
			n.log.Info("reconnected to NATS", "url", n.nc.ConnectedUrl())
			n.eachAgent((*region.Agent).Reconnected)
		case nats.CLOSED:
			n.fence("the NATS connection is closed")
			n.finish(ErrConnectionClosed)
		}
	}
}

func (n *Node) fence(why string) { n.eachAgent(func(a *region.Agent) { a.Fence(why) }) }

// eachAgent calls f with the region agent of every hosted type that has one.
func (n *Node) eachAgent(f func(*region.Agent)) {
	for _, h := range n.hostedTypes() {
		if h.agent != nil {
			f(h.agent)
		}
	}
}

func (n *Node) hostedTypes() []*hosted {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]*hosted(nil), n.types...)
}

// host opens type t's state, region and coordinator candidate.
func (n *Node) host(ctx context.Context, t Type) error {
	log := n.log.With("type", t.Name)
	subjects, err := protocol.NewSubjects(n.opts.DataPrefix, n.opts.ControlPrefix, t.Name)
	if err != nil {
		return fmt.Errorf("natshard: type %q: %w", t.Name, err)
	}
	if t.Replicas == 0 && n.srv != nil && n.opts.Server.clustered() {
		t.Replicas = clusterReplicas(n.opts.Server) // an embedded cluster's size, at most 3
	}
	t = t.withLocalDefaults() // the byte limits are needed before the stored configuration is read
	h := &hosted{t: t, node: n, log: log, subjects: subjects, tracer: n.tracer}
	// What the type needs from JetStream is retried while JetStream is
	// only unavailable (startwait.go).
	bucket := "its KV bucket " + kvstate.BucketName(t.Name)
	err = h.untilAvailable(ctx, bucket, func(ctx context.Context) (err error) {
		h.store, err = kvstate.Open(ctx, n.js, t.Name, kvstate.Options{Replicas: t.Replicas, MaxBytes: t.BucketBytes, Logger: log})
		return err
	})
	if err != nil {
		return fmt.Errorf("natshard: type %q: open its KV bucket: %w%s", t.Name, err, spaceHint(err, "BucketBytes", t.BucketBytes))
	}
	store := h.store
	err = h.untilAvailable(ctx, "its stored configuration in "+kvstate.BucketName(t.Name), func(ctx context.Context) (err error) {
		h.t, h.config, err = t.ensureConfig(ctx, store, log)
		return err
	})
	if err != nil {
		return fmt.Errorf("natshard: %w", err)
	}
	t = h.t
	strategy, _, err := strategies.Parse(t.Strategy)
	if err != nil {
		return fmt.Errorf("natshard: type %q: its stored strategy: %w", t.Name, err)
	}
	err = h.untilAvailable(ctx, "its handoff buffer stream "+kvstate.BufferStream(t.Name), func(ctx context.Context) (err error) {
		h.buffer, err = kvstate.OpenBuffer(ctx, n.js, subjects, kvstate.BufferOptions{Replicas: t.Replicas, MaxPerShard: int64(t.BufferSize), MaxBytes: t.BufferBytes, Shards: t.Shards, Logger: log})
		return err
	})
	if err != nil {
		return fmt.Errorf("natshard: type %q: open its handoff buffer: %w%s", t.Name, err, spaceHint(err, "BufferBytes", t.BufferBytes))
	}
	buffer := h.buffer
	if t.Delivery == Durable {
		err = h.untilAvailable(ctx, "its message stream "+kvstate.MessageStream(t.Name), func(ctx context.Context) (err error) {
			h.stream, err = kvstate.OpenStream(ctx, n.js, subjects, kvstate.StreamOptions{Replicas: t.Replicas, MaxBytes: t.StreamBytes, Shards: t.Shards, Logger: log})
			return err
		})
		if err != nil {
			return fmt.Errorf("natshard: type %q: open its message stream: %w%s", t.Name, err, spaceHint(err, "StreamBytes", t.StreamBytes))
		}
	}
	stream := h.stream
	if t.daemon != nil {
		// Before the region: its first workers start as soon as it binds.
		if h.daemon, err = h.openDaemon(ctx, t.daemon); err != nil {
			return err
		}
	}
	layout, err := h.config.Layout()
	if err != nil {
		return fmt.Errorf("natshard: type %q: its stored shard counts: %w", t.Name, err)
	}
	observed := n.metrics != nil || n.tracer != nil
	n.client.Learn(subjects, t.Shards, string(t.Delivery))
	if !n.opts.NoRegion {
		cfg := region.Config{
			Conn: n.nc, Store: store, Buffer: buffer, Stream: stream, Subjects: subjects, Shards: t.Shards, Layout: layout,
			ID: n.opts.Region, Version: n.opts.Version, Factory: h.factory,
			IdleTimeout: t.IdleTimeout, MaxActive: t.MaxActive, PassivationPolicy: t.PassivationPolicy, LeaseTTL: n.opts.LeaseTTL, ReleaseGrace: n.opts.ReleaseGrace,
			MaxHeld: t.BufferSize, Logger: log, Trace: h.traceMessage,
			// Half the handoff timeout: a region that did not run for
			// longer may have lost a shard to a forced reallocation.
			StallLimit: t.HandOffTimeout / 2,
		}
		if t.Remember {
			cfg.Remember, cfg.RestartRate = store, t.RestartRate
		}
		if observed {
			cfg.OnStep = h.regionStep
		}
		err = h.untilAvailable(ctx, "the region's registration in "+kvstate.BucketName(t.Name), func(ctx context.Context) (err error) {
			h.agent, err = region.Open(ctx, cfg)
			return err
		})
		if err != nil {
			return fmt.Errorf("natshard: type %q: %w", t.Name, err)
		}
	}
	n.mu.Lock()
	n.types = append(n.types, h)
	n.mu.Unlock()
	if h.agent != nil {
		if !n.nc.IsConnected() {
			h.agent.Fence("disconnected from NATS") // watchConn may have come too early
		}
		if h.daemon != nil {
			h.daemon.start()
		}
		go func() {
			select {
			case <-h.agent.Done():
				n.finish(fmt.Errorf("natshard: type %q: %w", t.Name, h.agent.Err()))
			case <-n.stopping:
			}
		}()
	}
	h.coordinatorDone = make(chan struct{})
	if n.opts.NoCoordinator {
		h.stopCoordinator = func() {}
		close(h.coordinatorDone)
	} else {
		h.coordStats = &coordinator.Stats{}
		cfg := coordinator.Config{
			Conn: n.nc, Store: store, Buffer: buffer, Durable: stream != nil, Subjects: subjects, Shards: t.Shards, Region: n.opts.Region,
			Strategy: strategy, MinRegions: t.MinRegions, LeaseTTL: n.opts.LeaseTTL, Logger: log,
			HandOffTimeout: t.HandOffTimeout, RebalanceInterval: t.RebalanceInterval,
			MaxMoves: t.MaxMoves, ReleaseGrace: n.opts.ReleaseGrace, Disconnects: n.disconnect, Stats: h.coordStats,
		}
		if observed {
			cfg.OnMove = h.coordinatorMove
		}
		c := coordinator.New(cfg)
		cctx, cancel := context.WithCancel(context.Background())
		h.stopCoordinator = cancel
		go func() {
			defer close(h.coordinatorDone)
			if err := c.Run(cctx); err != nil {
				log.Error("coordinator stopped", "err", err)
			}
		}()
	}
	log.Info("hosting type", "region", n.opts.Region, "kind", t.Kind, "shards", t.Shards, "strategy", t.Strategy, "delivery", t.Delivery,
		"region_hosted", !n.opts.NoRegion, "coordinator_candidate", !n.opts.NoCoordinator)
	return nil
}

// spaceHint completes the error of a stream that could not be created
// for lack of space with the knob that sizes it.
func spaceHint(err error, field string, bytes int64) string {
	if !errors.Is(err, kvstate.ErrNoSpace) {
		return ""
	}
	flag := "--" + strings.ToLower(strings.TrimSuffix(field, "Bytes")) + "-bytes"
	return fmt.Sprintf(" (it was to reserve %d bytes: lower Type.%s, shardd %s, or give the JetStream store more room: max_file_store)", bytes, field, flag)
}

// factory activates an entity of h's type: the Type's Factory, given the
// entity's Env in its context.
func (h *hosted) factory(ctx context.Context, id string) (Entity, error) {
	n := h.node
	env := &Env{
		Type: h.t.Name, ID: id, Shard: h.shardOf(id), Region: n.opts.Region, Delivery: h.t.Delivery,
		Store: h.store, Conn: n.nc, Client: n.client, log: h.log, h: h,
	}
	ent, err := h.t.Entity(withEnv(ctx, env), id)
	return env.keeper(ent), err
}

// shardOf is entity id's shard, by the counts the region routes by now
// (they change when the type is resharded).
func (h *hosted) shardOf(id string) int {
	if h.agent != nil {
		return h.agent.Layout().ShardOf(id)
	}
	return protocol.ShardOf(id, h.t.Shards)
}

// Stop stops the node gracefully: every type's region leaves (its shards
// are handed off to the other processes, nothing is lost), until ctx ends;
// shards still held then are re-homed by the coordinator as after a crash.
// Then, whatever ctx, for at most 20 seconds: the regions stop their
// entities (running their Stop hooks) and deregister, the coordinators
// release their leases, the connection drains (unless it is the
// caller's), the embedded server stops. It returns ErrClosed when the
// node was stopped already.
func (n *Node) Stop(ctx context.Context) error { return n.shutdown(ctx, true) }

// Close stops the node without handing its shards off first: as Stop
// after a leave that ended at once. The coordinator re-homes the shards as
// after a crash (at once, as the regions deregister), and messages sent to
// them meanwhile are lost.
func (n *Node) Close(ctx context.Context) error { return n.shutdown(ctx, false) }

func (n *Node) shutdown(ctx context.Context, leave bool) error {
	first := false
	n.stopOnce.Do(func() { first = true })
	if !first {
		<-n.stopped
		return ErrClosed
	}
	defer close(n.stopped)
	close(n.stopping)
	types := n.hostedTypes()
	for _, h := range types {
		if h.daemon != nil {
			h.daemon.end() // no more keep-alives: the workers stop with the region
		}
	}
	if leave {
		n.log.Info("stopping: leaving, waiting for the shards to be handed off")
		var wg sync.WaitGroup
		for _, h := range types {
			if h.agent != nil {
				wg.Go(func() { h.leave(ctx) })
			}
		}
		wg.Wait()
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
	defer cancel()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, h := range types {
		if h.agent == nil {
			continue
		}
		wg.Go(func() {
			if err := h.agent.Close(cctx); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("natshard: type %q: %w", h.t.Name, err))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, h := range types {
		h.stopCoordinator()
	}
	for _, h := range types {
		<-h.coordinatorDone
	}
	n.nc.RemoveStatusListener(n.status)
	<-n.watchDone
	if n.ownsSys {
		n.sys.Close()
	}
	n.closeConn()
	n.shutdownServer()
	n.unregisterMetrics()
	n.finish(nil)
	n.log.Info("natshard node stopped", "region", n.opts.Region)
	return errors.Join(errs...)
}

// leave hands h's shards off, unless nobody can take them.
func (h *hosted) leave(ctx context.Context) {
	lctx, cancel := context.WithTimeout(ctx, LeaveTimeout)
	defer cancel()
	switch _, _, err := h.store.Coordinator(lctx); {
	case !h.node.nc.IsConnected():
		h.log.Warn("not connected to NATS: the shards are not handed off", "shards", len(h.agent.Held()))
	case errors.Is(err, kvstate.ErrNotFound):
		h.log.Warn("no coordinator is running: the shards are not handed off; messages sent to them are lost until a coordinator re-homes them", "shards", len(h.agent.Held()))
	default:
		if err := h.agent.Leave(lctx); err != nil {
			h.log.Warn("shards not all handed off in time; the coordinator re-homes the rest as after a crash", "err", err, "shards", h.agent.Held())
		}
	}
}

// closeConn drains a connection the node made (waiting for it to close
// for at most closeTimeout), and leaves the caller's alone.
func (n *Node) closeConn() {
	if !n.ownsConn {
		return
	}
	if err := n.nc.Drain(); err != nil {
		n.log.Warn("drain", "err", err)
	}
	deadline := time.Now().Add(closeTimeout)
	for !n.nc.IsClosed() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	n.nc.Close()
}

// unregisterMetrics removes the node's collectors from Options.Metrics.
func (n *Node) unregisterMetrics() {
	if n.metrics != nil {
		n.metrics.unregister()
	}
}

// shutdownServer stops the embedded server. A cluster member first hands
// the leadership of its JetStream assets to the other members and closes
// its clients (they reconnect to the others), in lameDuck: nats-server's
// lame duck mode.
func (n *Node) shutdownServer() {
	if n.srv == nil {
		return
	}
	if n.opts.Server.clustered() {
		n.srv.LameDuckShutdown()
	}
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
}

// finish closes Done, with err as the reason (nil for a stop).
func (n *Node) finish(err error) {
	n.doneOnce.Do(func() {
		n.failErr = err
		close(n.done)
		if err != nil {
			n.log.Error("natshard node failed; stop it", "err", err)
		}
	})
}

// Done is closed when the node stops serving: when Stop or Close is
// called, or by itself when it cannot go on (Err says why: its connection
// was closed, or another process took its region id over). After a
// failure, call Close (Run does).
func (n *Node) Done() <-chan struct{} { return n.done }

// Err says why the node failed; nil while it serves, and after Stop or
// Close unless it had failed before.
func (n *Node) Err() error {
	select {
	case <-n.done:
		return n.failErr
	default:
		return nil
	}
}

// Conn is the node's NATS connection.
func (n *Node) Conn() *nats.Conn { return n.nc }

// Client is a Client on the node's connection.
func (n *Node) Client() *Client { return n.client }

// ClientURL is the URL of the embedded server, for other processes and
// clients to join; "" when the node connected to servers of its own.
func (n *Node) ClientURL() string {
	if n.srv == nil {
		return ""
	}
	return n.srv.ClientURL()
}

// Region is the node's region id.
func (n *Node) Region() string { return n.opts.Region }

// Options are the node's options as it applies them: defaults filled in,
// LeaseTTL and ReleaseGrace (Off for none) chosen for the server it
// reached.
func (n *Node) Options() Options { return n.opts }

// Stats are counters of a type's region in a node, since it started.
type Stats struct {
	Shards   []int // held (serving, replaying or handing off), ascending
	Entities int   // entities held (active, being created or stopped)

	Delivered         uint64 // messages handed to entities (live, replayed or held)
	Malformed         uint64 // messages with a malformed subject or the wrong shard
	NotOwned          uint64 // messages for a shard this region no longer serves
	Buffered          uint64 // messages of shards being handed off given to the buffer
	BufferFailed      uint64 // of those, refused by the buffer (full, or an error): lost, answered with an error
	Replayed          uint64 // buffered messages replayed to entities
	Held              uint64 // arrivals held while their shard's buffer was replayed or the region suspended
	HeldOverflow      uint64 // arrivals refused while replaying or suspended: too many held
	DuplicatesSkipped uint64 // copies skipped by their key (Message.Key: a Nats-Msg-Id, or a request's reply subject marked unique)
	CommandsRefused   uint64 // coordinator commands refused (stale epoch, another incarnation, garbage, or closing, not registered, suspended)

	BufferFull      uint64 // of BufferFailed, refused because the shard's buffer was full
	RefusedStopping uint64 // messages refused because their shard's entities were stopping
	Handled         uint64 // messages whose handling ended (Handle returned or panicked, or activation failed)
	Failed          uint64 // of those, ended in an error
	Activations     uint64 // entities activated
	Passivations    uint64 // entities passivated: idle, beyond Type.MaxActive, or at their request (Env.Passivate)
	OverLimit       uint64 // of those, passivated because the region held more than Type.MaxActive
	Restarted       uint64 // remembered entities started again without a message (Type.Remember)
	Fenced          uint64 // times the region fenced itself
	RenewalsFailed  uint64 // registration renewals that failed
	// OldSubject counts the messages taken from an ancestor's subject:
	// published with a shard count the type had before a split.
	OldSubject uint64
}

// Stats returns the counters of the hosted type name's region; false when
// the node hosts no region of it.
func (n *Node) Stats(name string) (Stats, bool) {
	for _, h := range n.hostedTypes() {
		if h.t.Name != name || h.agent == nil {
			continue
		}
		a := h.agent
		s := a.Stats()
		e := a.EntityCounts()
		return Stats{
			Shards: a.Held(), Entities: e.Active,
			Delivered: e.Delivered, Malformed: s.Malformed.Load(), NotOwned: s.NotOwned.Load(),
			Buffered: s.Buffered.Load(), BufferFailed: s.BufferFailed.Load(), Replayed: s.Replayed.Load(),
			Held: s.Held.Load(), HeldOverflow: s.HeldOverflow.Load(), DuplicatesSkipped: s.DuplicatesSkipped.Load(),
			CommandsRefused: s.Refused.Load(), BufferFull: s.BufferFull.Load(), RefusedStopping: e.RefusedStopping,
			Handled: e.Handled, Failed: e.Failed, Activations: e.Activations, Passivations: e.Passivations, OverLimit: e.OverLimit,
			Restarted: s.Restarted.Load(), Fenced: s.Fenced.Load(), RenewalsFailed: s.RenewalsFailed.Load(),
			OldSubject: s.OldSubject.Load(),
		}, true
	}
	return Stats{}, false
}

// StateStore returns the state store of the hosted type name: its KV
// bucket, the Env.Store its entities get, for code outside the entities
// (package sidecar's state API); false when the node does not host the
// type. It exists once Start returned, before any entity of the type
// activated, and stays usable until the node stops.
func (n *Node) StateStore(name string) (StateStore, bool) {
	for _, h := range n.hostedTypes() {
		if h.t.Name == name {
			return h.store, true
		}
	}
	return nil, false
}

// Types lists the names of the node's types, in the order Start was given
// them.
func (n *Node) Types() []string {
	var out []string
	for _, h := range n.hostedTypes() {
		out = append(out, h.t.Name)
	}
	return out
}

// Type returns the hosted type name as the node applies it: the stored
// shard count (after a split the node's region took part in, the new
// one), strategy and kind, and the defaults of the fields the Type left
// zero.
func (n *Node) Type(name string) (Type, bool) {
	for _, h := range n.hostedTypes() {
		if h.t.Name == name {
			t := h.t
			if h.agent != nil {
				t.Shards = h.agent.Layout().Shards() // after a split, the new count
			}
			return t, true
		}
	}
	return Type{}, false
}
