package natshard

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
	"github.com/natshard/natshard/strategies"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// Off turns off a duration where zero means "the default": an IdleTimeout
// of Off never passivates, a RebalanceInterval of Off runs no periodic
// rebalance round, a ReleaseGrace of Off keeps no grace.
const Off time.Duration = -1

// Defaults. They are shardd's defaults too: shardd's flags start from
// them, and a zero field of Options or Type means the default here (or,
// for what a type stores, the stored value).
const (
	DefaultShards            = protocol.DefaultShards               // shards of a new type
	DefaultStrategy          = strategies.DefaultSpec               // strategy of a new type
	DefaultReplicas          = 1                                    // replicas of a new type's bucket and buffer
	DefaultIdleTimeout       = region.DefaultIdleTimeout            // entities idle this long are passivated
	DefaultHandOffTimeout    = coordinator.DefaultHandOffTimeout    // a region that takes longer to pause a shard loses it
	DefaultRebalanceInterval = coordinator.DefaultRebalanceInterval // between the strategy's rounds
	DefaultMaxMoves          = coordinator.DefaultMaxMoves          // moves of live shards in flight
	DefaultBufferSize        = kvstate.DefaultBufferPerShard        // messages buffered per moving shard
	DefaultMinRegions        = 1                                    // regions registered before the first allocation
	DefaultRestartRate       = region.DefaultRestartRate            // remembered entities started per second by a process
	DefaultBucketBytes       = 1 << 30                              // bytes of a new type's KV bucket
	DefaultBufferBytes       = 1 << 30                              // bytes of a new type's buffer stream
	DefaultStreamBytes       = 1 << 30                              // bytes of a new durable type's message streams together
	DefaultListen            = "127.0.0.1:4222"                     // the embedded server's address
	// With a zero Options.LeaseTTL, the leases of coordinators and
	// regions live StandaloneLeaseTTL on a standalone NATS server and
	// ClusterLeaseTTL on a cluster, where it must outlive a JetStream
	// leader election (nats-server waits 4-9 s before it elects a new
	// leader of a stream whose leader's server died: with a shorter TTL
	// every region fences itself whenever the server leading the type's
	// bucket dies; docs/FAULTS.md).
	StandaloneLeaseTTL = 4 * time.Second
	ClusterLeaseTTL    = 15 * time.Second
	// With a zero Options.ReleaseGrace, the source of a handoff keeps
	// diverting for ClusterReleaseGrace after the new owner subscribed on
	// a cluster (its interest reaches the other servers asynchronously),
	// and not at all on a standalone server, where every publisher is on
	// the new owner's server.
	ClusterReleaseGrace = region.DefaultReleaseGrace
	// LeaveTimeout bounds the graceful leave of Run's stop, and shardd's.
	LeaveTimeout = 30 * time.Second
	// closeTimeout bounds the rest of a stop: entities' stop hooks,
	// deregistration, the lease's release, the connection's drain.
	closeTimeout = 20 * time.Second
)

// DefaultDataDir is where the embedded server stores JetStream when
// ServerOptions.DataDir is empty: $XDG_STATE_HOME/natshard, or
// ~/.local/state/natshard; "" when neither is known.
func DefaultDataDir() string {
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "natshard")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return ""
	}
	return filepath.Join(home, ".local", "state", "natshard")
}

// DefaultRegion is a region id unique on this machine: hostname-pid, with
// every character that a region id may not hold replaced by '-'.
func DefaultRegion() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "natshard"
	}
	host = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' {
			return r
		}
		return '-'
	}, host)
	if len(host) > 40 {
		host = host[:40]
	}
	return fmt.Sprintf("%s-%d", host, os.Getpid())
}

// Options configure a Node: how it reaches NATS, and what it is.
//
// The connection is Conn if set, else a new one to the servers in NATS,
// else one to an embedded server that the Node starts from Server.
type Options struct {
	// Conn is a connection the caller owns: the Node uses it and leaves
	// it open when it stops. Its status is watched (nats.Conn's
	// StatusChanged), its handlers are left alone. Connect it with
	// ConnectOptions, whose short pings natshard relies on; the Node warns
	// when it pings less often.
	Conn *nats.Conn
	// NATS is a comma-separated list of server URLs to connect to, with
	// ConnectOptions, Creds and TLS.
	NATS string
	// Creds is a NATS credentials file (a region user's: shardctl auth).
	// With Server.AuthDir, it defaults to that directory's region.creds.
	Creds string
	// TLS is the client side of TLS to the servers in NATS.
	TLS TLSFiles
	// Server configures the embedded server, started when neither Conn
	// nor NATS is set.
	Server ServerOptions
	// SystemConn (a connection the caller owns) or SystemCreds (a
	// credentials file the node connects to NATS with) reach the servers'
	// system account, where they publish that a client connection closed:
	// the coordinator then probes a region whose process died at once
	// instead of at its next probe (every 500 ms), and a candidate its
	// coordinator. The embedded server has such an account of its own
	// (not in operator mode: there, give SystemCreds of a user of the
	// operator's system account). Without them everything works, only
	// later.
	SystemConn  *nats.Conn
	SystemCreds string

	// Region is this node's region id, unique among the processes that
	// host a type; the default is DefaultRegion(). A process that finds
	// its id served by another live process refuses to start.
	Region string
	// Version is the application's version, for rolling updates: no
	// rebalance round runs while regions of different versions are
	// registered.
	Version string
	// Name of the connection the node makes, as NATS monitoring shows it
	// (and the servers' disconnect advisories); "natshard <Region>" by
	// default.
	Name string
	// NoCoordinator: host regions but never take a coordinator lease.
	NoCoordinator bool
	// NoRegion: host no region, only the coordinator candidates: a
	// dedicated coordinator process (the Types' Entity may then be nil).
	NoRegion bool
	// LeaseTTL of the coordinator and region leases, whole seconds, at
	// least 2 s; zero chooses StandaloneLeaseTTL or ClusterLeaseTTL from
	// the server the connection reaches.
	LeaseTTL time.Duration
	// ReleaseGrace: how long the source of a handoff keeps diverting after
	// the new owner subscribed; zero chooses from the server (see
	// ClusterReleaseGrace), Off is none. Set it where regions sit behind
	// different leaf nodes of one standalone server (docs/OPERATIONS.md).
	ReleaseGrace time.Duration
	// DataPrefix and ControlPrefix of subjects; empty means "shard" and
	// "$SHARD".
	DataPrefix    string
	ControlPrefix string
	// Logger gets what the node has to say; nil means slog.Default().
	Logger *slog.Logger

	// Metrics, when set, gets the node's Prometheus collectors at Start
	// (natshard_* metrics with labels type and region: docs/OPERATIONS.md);
	// they are unregistered when the node stops. natshard registers
	// nothing in the global registry. nil: no metric (Node.Stats still
	// reads the counters).
	Metrics prometheus.Registerer
	// TracerProvider, when set, makes OpenTelemetry spans: one for the
	// handling of each message that carries a W3C traceparent header, and
	// the steps of handoffs. nil: no span; either way the trace context of
	// a message reaches its entity's factory and Handle (tracing.go).
	TracerProvider trace.TracerProvider
	// ReadyAfter: for this long after Start, Ready waits until a
	// coordinator took each region in and its first replays are done;
	// after it, ready means connected and registered (Akka's
	// disabled-after: a rolling update cannot stall). Zero means
	// DefaultReadyAfter; Off waits for ever.
	ReadyAfter time.Duration
	// StartTimeout bounds how long Start waits for JetStream: opening each
	// type's bucket and streams, agreeing on its stored configuration and
	// the region's first registration are retried while JetStream is only
	// unavailable (a cluster forming or electing a leader, a server
	// starting), for at most this long from Start's call; then Start fails
	// with ErrStartTimeout. Zero means DefaultStartTimeout. Start's context
	// ends the wait too. What waiting cannot cure (a stored configuration
	// that disagrees, a region id in use, a permission denied) fails at
	// once.
	StartTimeout time.Duration
	// OnStartWait, when set, is told what Start waits for each time an
	// attempt failed for JetStream's unavailability, and the zero
	// StartWait once that wait is over (passed or failed): a process
	// answering health probes before Start returned says so (package
	// web's Handler.SetStartWait). It is called on Start's goroutine, and
	// never after Start returned.
	OnStartWait func(StartWait)
}

// ServerOptions configure the embedded NATS server.
type ServerOptions struct {
	// Listen is its client address, host:port; empty means DefaultListen.
	// Port 0 picks a free port (Node.ClientURL tells which).
	Listen string
	// DataDir holds its JetStream store; empty means DefaultDataDir().
	DataDir string
	// AuthDir is a directory made by shardctl auth init: the server runs
	// in operator mode with its accounts, and the node connects with its
	// region.creds unless Options.Creds says otherwise.
	AuthDir string
	// TLS: with Cert and Key the server requires TLS of its clients, with
	// CA also a client certificate signed by it. The node itself connects
	// in process. (Routes between the members of an embedded cluster are
	// not encrypted: keep the Cluster port on a private network.)
	TLS TLSFiles

	// Cluster is the address, host:port, on which the server listens for
	// the routes of the other members of an embedded cluster
	// (nats-server's --cluster), like 0.0.0.0:6222; empty: a standalone
	// server. With it, Routes is required: the servers of several
	// processes then form one NATS cluster with JetStream on every member,
	// and the types' replicas follow its size (Type.Replicas). Three
	// members survive the loss of any one (docs/OPERATIONS.md, "An
	// embedded cluster").
	Cluster string
	// Routes are the route URLs of the cluster's members, like
	// nats-route://host-1:6222 (nats-server's --routes). Give every
	// member the same list, itself included, as nats-server's
	// documentation does: a route to itself is ignored, and the list's
	// length is the cluster's size that JetStream expects.
	Routes []string
	// ClusterName is the cluster's name, the same on every member;
	// empty means DefaultClusterName.
	ClusterName string
	// Name is the server's name in the cluster, unique among its members
	// and stable across restarts on one DataDir (JetStream knows its peers
	// by it). Empty: the name kept in DataDir, or on a first start
	// "natshard-<Options.Region>", kept there.
	Name string
}

// TLSFiles name PEM files.
type TLSFiles struct {
	Cert string // certificate, with Key
	Key  string
	CA   string // CA certificates that sign the other side's
}

// ConnectOptions are the nats.go options natshard connects with: a ping
// every 2 s with 2 outstanding at most, so that a dead server or a cut
// network is noticed in seconds instead of minutes (a region that does not
// notice keeps its subscriptions on a server while messages vanish), and
// reconnection for ever, every 500 ms. Use them for a connection given in
// Options.Conn.
func ConnectOptions() []nats.Option {
	return []nats.Option{
		nats.PingInterval(pingInterval),
		nats.MaxPingsOutstanding(2),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(500 * time.Millisecond),
	}
}

const pingInterval = 2 * time.Second

// auth is the client authentication of o.
func (o *Options) auth() auth.Client {
	return auth.Client{Creds: o.Creds, TLSCert: o.TLS.Cert, TLSKey: o.TLS.Key, TLSCA: o.TLS.CA}
}

// withDefaults returns o with its defaults applied, those that do not
// depend on the server.
func (o Options) withDefaults() Options {
	if o.Region == "" {
		o.Region = DefaultRegion()
	}
	if o.Name == "" {
		o.Name = "natshard " + o.Region
	}
	if o.Server.Listen == "" {
		o.Server.Listen = DefaultListen
	}
	if o.Server.DataDir == "" {
		o.Server.DataDir = DefaultDataDir()
	}
	if o.Server.AuthDir != "" && o.Creds == "" {
		o.Creds = filepath.Join(o.Server.AuthDir, "region.creds")
	}
	if o.DataPrefix == "" {
		o.DataPrefix = protocol.DefaultDataPrefix
	}
	if o.ControlPrefix == "" {
		o.ControlPrefix = protocol.DefaultControlPrefix
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.ReadyAfter == 0 {
		o.ReadyAfter = DefaultReadyAfter
	}
	if o.StartTimeout == 0 {
		o.StartTimeout = DefaultStartTimeout
	}
	return o
}

// validate checks o (with defaults applied) and names the field at fault.
func (o *Options) validate() error {
	var errs []error
	if err := protocol.ValidateName("Region", o.Region); err != nil {
		errs = append(errs, err)
	}
	if _, err := protocol.NewSubjects(o.DataPrefix, o.ControlPrefix, "t"); err != nil {
		errs = append(errs, fmt.Errorf("DataPrefix/ControlPrefix: %w", err))
	}
	if o.LeaseTTL != 0 && (o.LeaseTTL < 2*time.Second || o.LeaseTTL%time.Second != 0) {
		errs = append(errs, fmt.Errorf("LeaseTTL: %s must be whole seconds, at least 2s", o.LeaseTTL))
	}
	if o.ReleaseGrace < Off || o.ReleaseGrace > 10*time.Second {
		errs = append(errs, fmt.Errorf("ReleaseGrace: %s is out of range 0..10s (or Off)", o.ReleaseGrace))
	}
	if o.ReadyAfter < Off {
		errs = append(errs, fmt.Errorf("ReadyAfter: %s is negative (Off waits for ever)", o.ReadyAfter))
	}
	if o.StartTimeout < 0 {
		errs = append(errs, fmt.Errorf("StartTimeout: %s is negative", o.StartTimeout))
	}
	if o.NoRegion && o.NoCoordinator {
		errs = append(errs, errors.New("NoRegion and NoCoordinator: the node would host nothing"))
	}
	embedded := o.Conn == nil && o.NATS == ""
	if o.Conn != nil && o.NATS != "" {
		errs = append(errs, errors.New("Conn and NATS: give one or neither (neither starts an embedded server)"))
	}
	if embedded && o.Server.DataDir == "" {
		errs = append(errs, errors.New("Server.DataDir: needed for the embedded server"))
	}
	if !embedded && (o.Server.AuthDir != "" || o.Server.TLS != (TLSFiles{}) || o.Server.clustered()) {
		//lint:ignore ST1005 a Validate error begins with the name of the field at fault, as its others do
		errs = append(errs, errors.New("Server: configures the embedded server, which is not started with Conn or NATS"))
	}
	if embedded {
		errs = append(errs, o.Server.validateCluster()...)
	}
	if embedded && (o.TLS.Cert != "" || o.TLS.Key != "") {
		errs = append(errs, errors.New("TLS: the client side of TLS to NATS; for the embedded server set Server.TLS"))
	}
	if embedded && o.Server.TLS.CA != "" && o.Server.TLS.Cert == "" {
		errs = append(errs, errors.New("Server.TLS.CA: verifies the embedded server's clients, which then needs Server.TLS.Cert and Key"))
	}
	if o.Conn == nil {
		if err := o.auth().Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if o.SystemConn != nil && o.SystemCreds != "" {
		errs = append(errs, errors.New("SystemConn and SystemCreds: give one or neither"))
	}
	if o.SystemCreds != "" {
		if err := (auth.Client{Creds: o.SystemCreds}).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("SystemCreds: %w", err))
		}
		if o.Conn != nil {
			errs = append(errs, errors.New("SystemCreds: the node connects with them to Options.NATS (or the embedded server); with Options.Conn give SystemConn"))
		}
	}
	return errors.Join(errs...)
}

// leaseTTL resolves LeaseTTL for a server in cluster clusterName ("" for
// a standalone server).
func leaseTTL(ttl time.Duration, clusterName string) time.Duration {
	switch {
	case ttl != 0:
		return ttl
	case clusterName == "":
		return StandaloneLeaseTTL
	}
	return ClusterLeaseTTL
}

// releaseGrace resolves ReleaseGrace for a server in cluster clusterName
// ("" for a standalone server), as region and coordinator Configs take
// it: 0 their default, negative none.
func releaseGrace(grace time.Duration, clusterName string) time.Duration {
	switch {
	case grace == 0 && clusterName == "":
		return Off
	case grace == 0:
		return ClusterReleaseGrace
	}
	return grace
}
