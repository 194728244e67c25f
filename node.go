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

func (n *Node) hostedTypes() []*hosted {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]*hosted(nil), n.types...)
}

// streamsLockTTL bounds how long a process holds the lock of a durable
// type's message streams (kvstate.Store.LockStreams): a few updates.
const streamsLockTTL = 30 * time.Second

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
		// The streams capture the shards of a split under way too.
		capture := t.Shards
		if layout, err := h.config.Layout(); err == nil {
			capture = layout.Shards()
		}
		err = h.untilAvailable(ctx, "its message streams "+strings.Join(kvstate.MessageStreams(t.Name, h.config.Streams), ", "), func(ctx context.Context) (err error) {
			h.stream, err = kvstate.OpenStream(ctx, n.js, subjects, kvstate.StreamOptions{Replicas: t.Replicas, MaxBytes: t.StreamBytes, Streams: h.config.Streams, Shards: capture, Logger: log,
				// One process at a time updates the streams' subjects (a split).
				Lock: func(ctx context.Context) (func(), error) { return store.LockStreams(ctx, streamsLockTTL) }})
			return err
		})
		if err != nil {
			return fmt.Errorf("natshard: type %q: open its message streams: %w%s", t.Name, err, spaceHint(err, "StreamBytes", t.StreamBytes))
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
	NotOwned          uint64 // messages of a shard that left without a handoff, dropped unanswered: its next holder answers its own copy
	Buffered          uint64 // messages of shards being handed off given to the buffer
	BufferFailed      uint64 // of those, refused by the buffer (full, or an error): lost; answered with an error while the source was the shard's one holder
	Replayed          uint64 // buffered messages replayed to entities
	Held              uint64 // arrivals held while their shard's buffer was replayed or the region suspended
	HeldOverflow      uint64 // arrivals beyond the held limit: refused while the shard pauses, dropped unanswered while it replays or is suspended
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
