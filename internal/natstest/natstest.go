package natstest

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// PingInterval is the servers' client ping interval: short, so that a dead
// client is noticed quickly.
const PingInterval = time.Second

// startTimeout bounds how long a server may take to accept connections, and
// a cluster to elect its JetStream meta leader.
const startTimeout = 30 * time.Second

// DefaultOptions returns the options RunServer uses: 127.0.0.1, random
// client port, JetStream storing in a fresh t.TempDir(), short ping
// interval, no logging, no signal handlers.
//
// The file store's limit (JetStreamMaxStore) is a bound, not an
// allocation: it is large (256 GiB) because every natshard type reserves
// its streams' max bytes in it (1 GiB each by default), and tests start
// many types on one server. A test of a full store sets a small one.
func DefaultOptions(t testing.TB) *server.Options {
	t.Helper()
	return &server.Options{
		ServerName:         "natstest",
		Host:               "127.0.0.1",
		Port:               -1,
		NoLog:              os.Getenv("NATSTEST_LOG") == "",
		NoSigs:             true,
		PingInterval:       PingInterval,
		MaxPingsOut:        2,
		JetStream:          true,
		StoreDir:           t.TempDir(),
		JetStreamMaxMemory: 256 << 20,
		JetStreamMaxStore:  256 << 30,
	}
}

// RunServer starts a single server with JetStream (DefaultOptions) and
// shuts it down on cleanup.
func RunServer(t testing.TB) *server.Server {
	t.Helper()
	return RunServerWithOptions(t, DefaultOptions(t))
}

// RunServerWithOptions starts a server with opts, waits until it accepts
// connections (and, with JetStream, until JetStream is enabled) and shuts it
// down on cleanup.
func RunServerWithOptions(t testing.TB, opts *server.Options) *server.Server {
	t.Helper()
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("natstest: new server: %v", err)
	}
	if !opts.NoLog {
		s.ConfigureLogger()
	}
	go s.Start()
	t.Cleanup(func() { Shutdown(s) })
	if !s.ReadyForConnections(startTimeout) {
		t.Fatalf("natstest: server %s not ready for connections after %v", opts.ServerName, startTimeout)
	}
	if opts.JetStream && opts.Cluster.Port == 0 {
		Eventually(t, startTimeout, "JetStream enabled", func() bool { return s.JetStreamEnabled() })
	}
	return s
}

// URL is the client URL of s (nats://127.0.0.1:port).
func URL(s *server.Server) string { return s.ClientURL() }

// Shutdown stops s and waits until it is down. Calling it for a server that
// is already down is harmless.
func Shutdown(s *server.Server) {
	s.Shutdown()
	s.WaitForShutdown()
}

// RunCluster starts an n-server JetStream cluster on 127.0.0.1: random
// client ports, cluster ports picked free beforehand and routed to each
// other, each server storing into its own t.TempDir(). It returns once the
// JetStream meta leader is elected and sees all n peers. The servers shut
// down on cleanup; Shutdown stops one of them earlier.
func RunCluster(t testing.TB, n int) []*server.Server {
	t.Helper()
	return RunClusterWith(t, n, nil)
}

// RunClusterWith is RunCluster with each server's options changed by
// adjust (when not nil) before it starts: a small JetStreamMaxStore, say.
func RunClusterWith(t testing.TB, n int, adjust func(*server.Options)) []*server.Server {
	t.Helper()
	opts := ClusterOptions(t, n)
	servers := make([]*server.Server, n)
	for i, o := range opts {
		if adjust != nil {
			adjust(o)
		}
		servers[i] = RunServerWithOptions(t, o)
	}
	WaitMetaLeader(t, servers)
	return servers
}

// ClusterOptions are the options of the n servers of a JetStream cluster
// that RunCluster starts (routed to each other on ports picked free), for
// a test that starts them itself with RunServerWithOptions, one at a time:
// a cluster with fewer than a majority of its servers up has no JetStream
// meta leader.
func ClusterOptions(t testing.TB, n int) []*server.Options {
	t.Helper()
	if n < 1 {
		t.Fatalf("natstest: cluster of %d servers", n)
	}
	ports := FreePorts(t, n)
	routes := make([]*url.URL, n)
	for i, p := range ports {
		routes[i] = &url.URL{Scheme: "nats-route", Host: fmt.Sprintf("127.0.0.1:%d", p)}
	}
	name := fmt.Sprintf("natstest-%d", time.Now().UnixNano()%1_000_000)
	opts := make([]*server.Options, n)
	for i := range n {
		o := DefaultOptions(t)
		o.ServerName = fmt.Sprintf("%s-s%d", name, i+1)
		o.Cluster = server.ClusterOpts{
			Name:     name,
			Host:     "127.0.0.1",
			Port:     ports[i],
			PoolSize: -1,
		}
		o.Routes = routes
		opts[i] = o
	}
	return opts
}

// WaitMetaLeader waits until servers have a JetStream meta leader that
// sees them all.
func WaitMetaLeader(t testing.TB, servers []*server.Server) {
	t.Helper()
	Eventually(t, startTimeout, fmt.Sprintf("JetStream meta leader with %d peers", len(servers)), func() bool {
		l := MetaLeader(servers)
		return l != nil && len(l.JetStreamClusterPeers()) == len(servers)
	})
}

// MetaLeader returns the server among servers that is the JetStream meta
// leader, or nil.
func MetaLeader(servers []*server.Server) *server.Server {
	for _, s := range servers {
		if s.Running() && s.JetStreamIsLeader() {
			return s
		}
	}
	return nil
}

// ClusterURLs is the comma-separated list of the client URLs of servers, as
// nats.Connect takes it.
func ClusterURLs(servers []*server.Server) string {
	urls := make([]string, len(servers))
	for i, s := range servers {
		urls[i] = s.ClientURL()
	}
	return strings.Join(urls, ",")
}

// Connect connects to url and closes the connection on cleanup. The
// connection gives up reconnecting after a few seconds, so tests that stop
// servers do not hang.
func Connect(t testing.TB, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	all := append([]nats.Option{
		nats.Name(t.Name()),
		nats.ReconnectWait(100 * time.Millisecond),
		nats.MaxReconnects(50),
	}, opts...)
	nc, err := nats.Connect(url, all...)
	if err != nil {
		t.Fatalf("natstest: connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// JetStream returns a JetStream context on nc.
func JetStream(t testing.TB, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("natstest: jetstream: %v", err)
	}
	return js
}

// FreePorts returns n distinct ports of 127.0.0.1 that were free a moment
// ago, picked at random below Linux's ephemeral range (32768 and up).
// Outgoing connections take their local ports from that range, and a busy
// test machine makes many: a port the kernel hands out as free there may
// be taken by one before the server binds it (CI saw a nats-server of a
// cluster fail so: "address already in use"). Another test may still bind
// a port first, which is far less likely.
func FreePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, 0, n)
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for try := 0; len(ports) < n; try++ {
		if try == 10_000 {
			t.Fatalf("natstest: no free port found between %d and %d", portsFrom, portsTo)
		}
		p := portsFrom + rand.IntN(portsTo-portsFrom)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue // taken
		}
		ls = append(ls, l) // held until all are picked: distinct
		ports = append(ports, p)
	}
	return ports
}

// The range FreePorts picks from.
const portsFrom, portsTo = 20_000, 32_000
