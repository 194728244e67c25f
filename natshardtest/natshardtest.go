// Package natshardtest runs natshard entity types in a test, as
// net/http/httptest runs handlers (Akka's ActorTestKit, Orleans'
// TestCluster): one call starts an embedded NATS server with JetStream
// on 127.0.0.1 (a random port, its store in t.TempDir()) and one or more
// nodes that host the types, and gives a client; everything stops when
// the test ends.
//
//	c := natshardtest.Start(t, cart.Type())
//	answer, err := c.Client().Request(t.Context(), "cart", "alice", []byte(`{"op":"get"}`))
//
// The server is natshard's own embedded server (as shardd's, with
// JetStream), run by a node of its own that hosts no region: the nodes
// that host the types connect to it as other processes would, and their
// crashes leave it up.
//
// The test can then do to the nodes what production does to processes:
// move a shard to another node (Move), passivate an entity (Passivate),
// stop a node gracefully (Stop: its shards are handed off) or crash it
// (Crash: no handoff, its shards are re-homed as after a kill), start it
// again on the same store (Restart), add a node (Add), and wait until
// every shard of a type is served exactly once (Settle).
//
// Nodes are numbered from 0 in the order they were started; node i is
// region "node-i" of every type. Unless the Type says otherwise, the kit
// makes the first allocation wait for all the nodes it starts
// (Type.MinRegions) and turns the periodic rebalance off
// (Type.RebalanceInterval = natshard.Off), so that shards move only when
// the test moves them or a node leaves: a test that wants the strategy's
// rounds sets RebalanceInterval.
//
// Waits are bounded by Timeout (30 s), generous for a loaded machine;
// a wait that ends fails the test.
package natshardtest

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// Timeout bounds each of the kit's waits.
const Timeout = 30 * time.Second

// Config configures a Cluster.
type Config struct {
	// Nodes is how many nodes to start (0 means 1).
	Nodes int
	// Types are the entity types every node hosts.
	Types []natshard.Type
	// Options is the template of every node's options. Region, NATS,
	// Conn and Server are the kit's; a nil Logger discards the logs.
	Options natshard.Options
}

// Cluster is an embedded NATS server and the nodes that host a test's
// types on it. Its methods fail the test (t.Fatal) when something does
// not happen within Timeout; call them from the test's goroutine.
type Cluster struct {
	t      testing.TB
	url    string
	cfg    Config
	client *natshard.Client
	admin  *nats.Conn

	mu    sync.Mutex
	nodes []*natshard.Node // nil: crashed or stopped
}

// Start starts a server and one node hosting types: Run with
// Config{Types: types}.
func Start(t testing.TB, types ...natshard.Type) *Cluster {
	t.Helper()
	return Run(t, Config{Types: types})
}

// Run starts a server and cfg.Nodes nodes hosting cfg.Types, and waits
// until every type is settled (Settle). They stop when the test ends.
func Run(t testing.TB, cfg Config) *Cluster {
	t.Helper()
	if len(cfg.Types) == 0 {
		t.Fatal("natshardtest: no type to host")
	}
	cfg.Nodes = max(cfg.Nodes, 1)
	cfg.Types = slices.Clone(cfg.Types)
	for i := range cfg.Types {
		if cfg.Types[i].MinRegions == 0 {
			cfg.Types[i].MinRegions = cfg.Nodes
		}
		if cfg.Types[i].RebalanceInterval == 0 {
			cfg.Types[i].RebalanceInterval = natshard.Off
		}
	}
	if cfg.Options.Logger == nil {
		cfg.Options.Logger = slog.New(slog.DiscardHandler)
	}
	c := &Cluster{t: t, cfg: cfg}
	c.startServer()
	c.admin = c.connect()
	c.client = natshard.NewClient(c.connect(), natshard.WithPrefix(cfg.Options.DataPrefix))
	t.Cleanup(c.closeAll)

	// Start the nodes at once: the first allocation waits for them all.
	nodes := make([]*natshard.Node, cfg.Nodes)
	errs := make([]error, cfg.Nodes)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() { nodes[i], errs[i] = c.start(i) })
	}
	wg.Wait()
	c.nodes = nodes
	for i, err := range errs {
		if err != nil {
			t.Fatalf("natshardtest: start node %d: %v", i, err)
		}
	}
	c.Settle()
	return c
}

// startServer starts the server: a node of natshard's own embedded
// server (as shardd's) that hosts no region, only coordinator candidates
// of the types, so that it outlives the crashes of the nodes. It stops
// after them.
func (c *Cluster) startServer() {
	c.t.Helper()
	opts := c.cfg.Options
	opts.Region = "natshardtest-server"
	opts.NATS, opts.Conn = "", nil
	opts.Server = natshard.ServerOptions{Listen: "127.0.0.1:0", DataDir: c.t.TempDir()}
	opts.NoRegion, opts.NoCoordinator = true, false
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	s, err := natshard.Start(ctx, opts, c.cfg.Types...)
	if err != nil {
		c.t.Fatalf("natshardtest: start the server: %v", err)
	}
	c.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		defer cancel()
		_ = s.Close(ctx)
	})
	c.url = s.ClientURL()
}

// connect is a connection of the test's to the server, closed when the
// test ends.
func (c *Cluster) connect() *nats.Conn {
	c.t.Helper()
	nc, err := nats.Connect(c.url, natshard.ConnectOptions()...)
	if err != nil {
		c.t.Fatalf("natshardtest: connect to %s: %v", c.url, err)
	}
	c.t.Cleanup(nc.Close)
	return nc
}

func (c *Cluster) start(i int) (*natshard.Node, error) {
	opts := c.cfg.Options
	opts.Region = Region(i)
	opts.NATS, opts.Conn, opts.Server = c.url, nil, natshard.ServerOptions{}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	return natshard.Start(ctx, opts, c.cfg.Types...)
}

func (c *Cluster) closeAll() {
	c.mu.Lock()
	nodes := slices.Clone(c.nodes)
	clear(c.nodes)
	c.mu.Unlock()
	var wg sync.WaitGroup
	for _, n := range nodes {
		if n != nil {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), Timeout)
				defer cancel()
				_ = n.Close(ctx)
			})
		}
	}
	wg.Wait()
}

// Region is the region id of node i: "node-i".
func Region(i int) string { return fmt.Sprintf("node-%d", i) }

// URL is the embedded server's client URL (nats://127.0.0.1:port), for
// a connection of the test's own (nats.Connect) or a node it starts
// itself.
func (c *Cluster) URL() string { return c.url }

// Client is a client on a connection of its own (as another process's):
// it outlives the nodes' crashes and restarts.
func (c *Cluster) Client() *natshard.Client { return c.client }

// Nodes is how many nodes were started (crashed and stopped ones too).
func (c *Cluster) Nodes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.nodes)
}

// Node is node i, nil while it is crashed or stopped.
func (c *Cluster) Node(i int) *natshard.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	if i < 0 || i >= len(c.nodes) {
		return nil
	}
	return c.nodes[i]
}

func (c *Cluster) live(i int) *natshard.Node {
	c.t.Helper()
	n := c.Node(i)
	if n == nil {
		c.t.Fatalf("natshardtest: node %d is not running", i)
	}
	return n
}

// Add starts another node hosting the types and returns its number. It
// gets shards when the test moves some to it (or, with a
// RebalanceInterval, from the strategy's rounds).
func (c *Cluster) Add() int {
	c.t.Helper()
	c.mu.Lock()
	i := len(c.nodes)
	c.nodes = append(c.nodes, nil)
	c.mu.Unlock()
	c.restart(i)
	return i
}

// Crash closes node i without handing its shards off, as a process that
// dies: its entities' Stop hooks run, but its shards go to the other
// nodes as after a crash (the coordinator re-homes them at once), and
// what was sent to them meanwhile is lost in core delivery (durable
// delivery's stream keeps it). It waits until the node is closed.
func (c *Cluster) Crash(i int) {
	c.t.Helper()
	c.down(i, func(ctx context.Context, n *natshard.Node) error { return n.Close(ctx) })
}

// Stop stops node i gracefully: its shards are handed off to the other
// nodes first, nothing is lost.
func (c *Cluster) Stop(i int) {
	c.t.Helper()
	c.down(i, func(ctx context.Context, n *natshard.Node) error { return n.Stop(ctx) })
}

func (c *Cluster) down(i int, stop func(context.Context, *natshard.Node) error) {
	c.t.Helper()
	n := c.live(i)
	c.mu.Lock()
	c.nodes[i] = nil
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if err := stop(ctx, n); err != nil {
		c.t.Fatalf("natshardtest: stop node %d: %v", i, err)
	}
}

// Restart starts node i again (after Crash or Stop), as the same region
// on the same server and store: persistent state and durable messages
// are where they were.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if c.Node(i) != nil {
		c.t.Fatalf("natshardtest: node %d is running", i)
	}
	c.restart(i)
}

func (c *Cluster) restart(i int) {
	c.t.Helper()
	n, err := c.start(i)
	if err != nil {
		c.t.Fatalf("natshardtest: start node %d: %v", i, err)
	}
	c.mu.Lock()
	c.nodes[i] = n
	c.mu.Unlock()
}

// shards returns the shard count of type typ.
func (c *Cluster) shards(typ string) int {
	c.t.Helper()
	for _, t := range c.cfg.Types {
		if t.Name == typ {
			shards := 0
			for _, n := range c.running() {
				if applied, ok := n.Type(typ); ok {
					shards = max(shards, applied.Shards) // a split: the nodes that split first
				}
			}
			return cmp.Or(shards, t.Shards, natshard.DefaultShards)
		}
	}
	c.t.Fatalf("natshardtest: no type %q", typ)
	return 0
}

func (c *Cluster) running() []*natshard.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*natshard.Node
	for _, n := range c.nodes {
		if n != nil {
			out = append(out, n)
		}
	}
	return out
}

// ShardOf is the shard of entity id of type typ.
func (c *Cluster) ShardOf(typ, id string) int {
	c.t.Helper()
	return protocol.ShardOf(id, c.shards(typ))
}

// Owner is the number of the running node that holds shard of type typ,
// -1 when none does (or, during a handoff, two do).
func (c *Cluster) Owner(typ string, shard int) int {
	owner := -1
	c.mu.Lock()
	nodes := slices.Clone(c.nodes)
	c.mu.Unlock()
	for i, n := range nodes {
		if n == nil {
			continue
		}
		if s, ok := n.Stats(typ); ok && slices.Contains(s.Shards, shard) {
			if owner >= 0 {
				return -1
			}
			owner = i
		}
	}
	return owner
}

// OwnerOf is the node that holds entity id's shard (Owner).
func (c *Cluster) OwnerOf(typ, id string) int {
	c.t.Helper()
	return c.Owner(typ, c.ShardOf(typ, id))
}

// Settle waits until every running node is ready (natshard.Node.Ready)
// and every shard of each type (of types, or of every type when none is
// named) is held by exactly one of them.
func (c *Cluster) Settle(types ...string) {
	c.t.Helper()
	if len(types) == 0 {
		for _, t := range c.cfg.Types {
			types = append(types, t.Name)
		}
	}
	c.Eventually("the types settled", func() bool {
		nodes := c.running()
		if len(nodes) == 0 {
			return false
		}
		for _, n := range nodes {
			if n.Ready() != nil {
				return false
			}
		}
		for _, typ := range types {
			n := c.shards(typ)
			for shard := range n {
				if c.Owner(typ, shard) < 0 {
					return false
				}
			}
		}
		return true
	})
}

// Move moves shard of type typ to node to and waits until node to alone
// holds it. A move asked while the shard's last move is not recorded
// done is asked again.
func (c *Cluster) Move(typ string, shard, to int) {
	c.t.Helper()
	c.live(to)
	subjects, err := protocol.NewSubjects(c.cfg.Options.DataPrefix, c.cfg.Options.ControlPrefix, typ)
	if err != nil {
		c.t.Fatalf("natshardtest: move: %v", err)
	}
	subject := subjects.Admin(protocol.AdminMove)
	body, _ := json.Marshal(protocol.MoveRequest{Shard: shard, Region: Region(to)})
	var last string
	c.Eventually(fmt.Sprintf("the move of shard %d of %s to node %d taken", shard, typ, to), func() bool {
		if c.Owner(typ, shard) == to {
			return true
		}
		m, err := c.admin.Request(subject, body, 5*time.Second)
		if err != nil {
			last = err.Error()
			return false
		}
		last = string(m.Data)
		return strings.Contains(last, `"ok":true`)
	}, func() string { return last })
	c.Eventually(fmt.Sprintf("shard %d of %s on node %d alone", shard, typ, to), func() bool {
		return c.Owner(typ, shard) == to
	})
}

// MoveEntity moves the shard of entity id of type typ to node to (Move),
// and returns the node that held it before (-1 if none did).
func (c *Cluster) MoveEntity(typ, id string, to int) (from int) {
	c.t.Helper()
	shard := c.ShardOf(typ, id)
	from = c.Owner(typ, shard)
	c.Move(typ, shard, to)
	return from
}

// Passivate stops entity id of type typ on the node that holds it, as an
// idle passivation does (its Stop hook runs; its next message activates
// a new incarnation), and waits until it has stopped. It reports whether
// a node held the entity.
func (c *Cluster) Passivate(typ, id string) bool {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	held := false
	for _, n := range c.running() {
		ok, err := n.Passivate(ctx, typ, id)
		if err != nil {
			c.t.Fatalf("natshardtest: passivate %s %s: %v", typ, id, err)
		}
		held = held || ok
	}
	return held
}

// Eventually polls cond every few milliseconds until it holds, and fails
// the test when it does not within Timeout, saying what it waited for
// (and, when given, the last thing that detail says).
func (c *Cluster) Eventually(what string, cond func() bool, detail ...func() string) {
	c.t.Helper()
	natstest.Eventually(c.t, Timeout, "natshardtest: "+what, func() error {
		if cond() {
			return nil
		}
		var said []string
		for _, d := range detail {
			said = append(said, d())
		}
		return errors.New(strings.Join(append([]string{"not yet"}, said...), ": "))
	})
}
