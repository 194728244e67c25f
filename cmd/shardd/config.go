package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/passivation"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/sidecar"
	"github.com/natshard/natshard/strategies"
)

// config is shardd's configuration: flags, with NATSHARD_* environment
// variables (and NATS_URL) as defaults.
type config struct {
	NATS    string
	Listen  string
	DataDir string
	// The embedded cluster (nats-server's flag names).
	Cluster       string   // --cluster: route listen address
	Routes        []string // --routes: every member's route URL
	ClusterName   string   // --cluster_name (--cluster-name)
	Type          string
	Kind          string
	TraceSubject  string
	Workers       int            // --kind daemon: the worker count of a new daemon; 0 the stored one
	Sidecar       sidecar.Config // --kind http: --app, --app-*, --state-listen
	Strategy      string         // canonical spec, or "" for the stored one
	Delivery      string         // core, durable, or "" for the stored one
	Shards        int
	Region        string
	Version       string
	NoCoordinator bool
	NoRegion      bool
	MinRegions    int
	Replicas      int
	IdleTimeout   time.Duration
	MaxActive     int
	Passivation   string // --passivation-policy
	Remember      bool   // --remember: remembered entities
	RestartRate   int
	LeaseTTL      time.Duration
	StartTimeout  time.Duration // how long the start waits for JetStream
	// Handoff and rebalance.
	HandOffTimeout    time.Duration
	RebalanceInterval time.Duration
	MaxMoves          int
	ReleaseGrace      time.Duration
	BufferSize        int
	// Byte limits of the type's streams when they are created
	// (natshard.Type.BucketBytes, ...); noLimit: none.
	BucketBytes   bytesFlag
	BufferBytes   bytesFlag
	StreamBytes   bytesFlag
	DataPrefix    string
	ControlPrefix string
	LogLevel      string
	LogFormat     string
	HTTP          string // --http: address of /metrics, /healthz, /readyz and /ui; "" none
	PrintVersion  bool   // --version: print the version and exit
	// Security (docs/SECURITY.md).
	AuthDir     string      // embedded server in operator mode; region.creds by default
	SystemCreds string      // a system account user's, for the servers' disconnect advisories
	Auth        auth.Client // --creds, --tls-*
}

// parseConfig reads the flags and the environment; --help goes to out.
func parseConfig(args []string, getenv func(string) string, out io.Writer) (config, error) {
	env := func(name, def string) string {
		if v := getenv(name); v != "" {
			return v
		}
		return def
	}
	var c config
	var errs []error
	envInt := func(name string, def int) int {
		if v := getenv(name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %q is not a whole number", name, v))
			}
			return n
		}
		return def
	}
	envDur := func(name string, def time.Duration) time.Duration {
		if v := getenv(name); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %q is not a duration (like 120s)", name, v))
			}
			return d
		}
		return def
	}
	envBool := func(name string) bool {
		if v := getenv(name); v != "" {
			b, err := strconv.ParseBool(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %q is not true or false", name, v))
			}
			return b
		}
		return false
	}
	fs := flag.NewFlagSet("shardd", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(out, "Usage: shardd [flags]\n\nRuns a natshard region (and coordinator candidate). With no NATS URL it starts\nan embedded NATS server with JetStream that other shardd and clients can join;\nwith --cluster and --routes the embedded servers of several shardd form one NATS\ncluster, which survives the loss of any one of three.\n\n--http serves Prometheus metrics, health probes and a live shard map. Traces go\nto an OTLP collector when the standard OTEL_* variables say so (for example\nOTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318); with none set, nowhere.\n\nFlags (environment variable in brackets):\n")
		fs.PrintDefaults()
	}
	fs.StringVar(&c.NATS, "nats", env("NATS_URL", ""), "NATS server URL(s), comma-separated; empty starts an embedded server [NATS_URL]")
	fs.StringVar(&c.Listen, "listen", env("NATSHARD_LISTEN", natshard.DefaultListen), "address of the embedded NATS server [NATSHARD_LISTEN]")
	fs.StringVar(&c.DataDir, "data-dir", env("NATSHARD_DATA_DIR", natshard.DefaultDataDir()), "JetStream store of the embedded server [NATSHARD_DATA_DIR]")
	fs.StringVar(&c.Cluster, "cluster", env("NATSHARD_CLUSTER", ""), "route listen address of the embedded server, host:port like 0.0.0.0:6222 (nats-server's --cluster): with --routes, the embedded servers of several shardd form one NATS cluster with JetStream on each, which survives the loss of any one of three (docs/OPERATIONS.md); empty: a standalone server [NATSHARD_CLUSTER]")
	routes := env("NATSHARD_ROUTES", "")
	fs.StringVar(&routes, "routes", routes, "with --cluster: the route URLs of every member of the embedded cluster, this one's included, comma-separated, like nats-route://host-1:6222,nats-route://host-2:6222,nats-route://host-3:6222 (nats-server's --routes); the same list on every member [NATSHARD_ROUTES]")
	clusterName := env("NATSHARD_CLUSTER_NAME", natshard.DefaultClusterName)
	fs.StringVar(&c.ClusterName, "cluster_name", clusterName, "with --cluster: the embedded cluster's name, the same on every member (nats-server's --cluster_name) [NATSHARD_CLUSTER_NAME]")
	fs.StringVar(&c.ClusterName, "cluster-name", clusterName, "same as --cluster_name")
	fs.StringVar(&c.Type, "type", env("NATSHARD_TYPE", "kv"), "entity type [NATSHARD_TYPE]")
	fs.StringVar(&c.Kind, "kind", env("NATSHARD_KIND", "kv"), "entity kind: kv, echo, trace (diagnostic), daemon (diagnostic workers kept running, --workers), or http (the entities live in the app at --app); stored per type, a process that disagrees refuses to start [NATSHARD_KIND]")
	fs.StringVar(&c.Sidecar.App, "app", env("NATSHARD_APP", ""), "with --kind http: the URL of the app that hosts the entities, like http://127.0.0.1:8080 (docs/SIDECAR.md) [NATSHARD_APP]")
	fs.IntVar(&c.Sidecar.Concurrency, "app-concurrency", envInt("NATSHARD_APP_CONCURRENCY", sidecar.DefaultConcurrency), "with --kind http: calls in flight to the app at most (and connections to it) [NATSHARD_APP_CONCURRENCY]")
	fs.DurationVar(&c.Sidecar.Timeout, "app-timeout", envDur("NATSHARD_APP_TIMEOUT", sidecar.DefaultTimeout), "with --kind http: bounds each call to the app, health check and state API request [NATSHARD_APP_TIMEOUT]")
	fs.DurationVar(&c.Sidecar.DownAfter, "app-down-after", envDur("NATSHARD_APP_DOWN_AFTER", sidecar.DefaultDownAfter), "with --kind http: an app that fails every health check this long is down: shardd leaves (its shards move to the others) and exits 1 [NATSHARD_APP_DOWN_AFTER]")
	fs.StringVar(&c.Sidecar.StateListen, "state-listen", env("NATSHARD_STATE_LISTEN", sidecar.DefaultStateListen), "with --kind http: loopback address of the state API for the app (port 0: a free one, given to the app in the Natshard-State-Url header) [NATSHARD_STATE_LISTEN]")
	fs.StringVar(&c.TraceSubject, "trace-subject", env("NATSHARD_TRACE_SUBJECT", ""), "where trace entities and daemon workers publish their records (default natshard.trace.<type>, natshard.daemon.<type>) [NATSHARD_TRACE_SUBJECT]")
	fs.IntVar(&c.Workers, "workers", envInt("NATSHARD_WORKERS", 0), "with --kind daemon: the worker count when the daemon is first started; then the stored count wins (shardctl scale changes it); 0 uses the stored count [NATSHARD_WORKERS]")
	fs.StringVar(&c.Delivery, "delivery", env("NATSHARD_DELIVERY", ""), "how messages reach the entities, stored per type: core (core NATS: Akka's semantics, the default for a new type) or durable (through the type's JetStream stream: nothing lost when a region crashes or a NATS server dies); empty uses the stored one [NATSHARD_DELIVERY]")
	fs.IntVar(&c.Shards, "shards", envInt("NATSHARD_SHARDS", 0), fmt.Sprintf("shard count; 0 uses the stored count, or %d for a new type; a count the type had before it was resharded (shardctl reshard) takes the stored one [NATSHARD_SHARDS]", natshard.DefaultShards))
	fs.StringVar(&c.Region, "region", env("NATSHARD_REGION", natshard.DefaultRegion()), "region id, unique per process; a process whose id another live process serves refuses to start [NATSHARD_REGION]")
	fs.StringVar(&c.Version, "app-version", env("NATSHARD_APP_VERSION", ""), "application version of this process, for rolling updates [NATSHARD_APP_VERSION]")
	fs.BoolVar(&c.NoCoordinator, "no-coordinator", envBool("NATSHARD_NO_COORDINATOR"), "host a region but never take the coordinator lease [NATSHARD_NO_COORDINATOR]")
	fs.BoolVar(&c.NoRegion, "no-region", envBool("NATSHARD_NO_REGION"), "host no region: only a coordinator candidate [NATSHARD_NO_REGION]")
	fs.IntVar(&c.MinRegions, "min-regions", envInt("NATSHARD_MIN_REGIONS", natshard.DefaultMinRegions), "allocate no shard before this many regions registered [NATSHARD_MIN_REGIONS]")
	fs.IntVar(&c.Replicas, "replicas", envInt("NATSHARD_REPLICAS", 0), fmt.Sprintf("replicas of the type's KV bucket and streams when they are created; 0 (auto): the embedded cluster's size at most 3 with --routes, else %d; give 3 on an external NATS cluster [NATSHARD_REPLICAS]", natshard.DefaultReplicas))
	fs.DurationVar(&c.IdleTimeout, "idle-timeout", envDur("NATSHARD_IDLE_TIMEOUT", natshard.DefaultIdleTimeout), "passivate entities idle this long; 0 never (and never with --remember) [NATSHARD_IDLE_TIMEOUT]")
	fs.IntVar(&c.MaxActive, "max-active", envInt("NATSHARD_MAX_ACTIVE", 0), "most active entities in this region: beyond it, idle ones are passivated, chosen by --passivation-policy; 0 no limit [NATSHARD_MAX_ACTIVE]")
	fs.StringVar(&c.Passivation, "passivation-policy", env("NATSHARD_PASSIVATION_POLICY", natshard.PassivationWTinyLFU), "which entities --max-active passivates: w-tinylfu (frequency-aware, Akka's default) or lru (least recently used) [NATSHARD_PASSIVATION_POLICY]")
	fs.BoolVar(&c.Remember, "remember", envBool("NATSHARD_REMEMBER"), "remember the active entities, stored per type: a shard's new owner starts them again without a message, after a move, a crash or a full restart; they are never passivated for idleness (an http app's entity ends with Natshard-Passivate) [NATSHARD_REMEMBER]")
	fs.IntVar(&c.RestartRate, "restart-rate", envInt("NATSHARD_RESTART_RATE", natshard.DefaultRestartRate), "remembered entities this process starts per second [NATSHARD_RESTART_RATE]")
	c.LeaseTTL = auto
	if v := getenv("NATSHARD_LEASE_TTL"); v != "" {
		if err := (*autoFlag)(&c.LeaseTTL).Set(v); err != nil {
			errs = append(errs, fmt.Errorf("NATSHARD_LEASE_TTL: %w", err))
		}
	}
	fs.Var((*autoFlag)(&c.LeaseTTL), "lease-ttl", fmt.Sprintf("TTL of the coordinator and region leases, whole seconds; auto: %s on a standalone NATS server, %s on a cluster (longer than a JetStream leader election) [NATSHARD_LEASE_TTL]", natshard.StandaloneLeaseTTL, natshard.ClusterLeaseTTL))
	fs.DurationVar(&c.StartTimeout, "start-timeout", envDur("NATSHARD_START_TIMEOUT", natshard.DefaultStartTimeout), "how long the start waits for JetStream (a cluster forming or electing its meta leader, a server starting): opening the type's bucket and streams is retried, logged every 5s, until then; shardd then exits 1 saying what it waited for. A stored configuration that disagrees fails at once [NATSHARD_START_TIMEOUT]")
	fs.StringVar(&c.Strategy, "strategy", env("NATSHARD_STRATEGY", ""), "allocation strategy, <name>[:<param>=<value>,...]: least-shard (default), legacy-least-shard, consistent-hashing, load-aware; stored per type, a process that disagrees refuses to start [NATSHARD_STRATEGY]")
	fs.DurationVar(&c.HandOffTimeout, "handoff-timeout", envDur("NATSHARD_HANDOFF_TIMEOUT", natshard.DefaultHandOffTimeout), "how long a region may take to pause a shard before it is reallocated [NATSHARD_HANDOFF_TIMEOUT]")
	fs.DurationVar(&c.RebalanceInterval, "rebalance-interval", envDur("NATSHARD_REBALANCE_INTERVAL", natshard.DefaultRebalanceInterval), "time between the starts of rebalance rounds (a round runs all its moves, --max-moves at a time); 0 disables them [NATSHARD_REBALANCE_INTERVAL]")
	fs.IntVar(&c.MaxMoves, "max-moves", envInt("NATSHARD_MAX_MOVES", natshard.DefaultMaxMoves), "shard moves in flight at once; a rebalance round starts its moves as earlier ones end [NATSHARD_MAX_MOVES]")
	c.ReleaseGrace = auto
	if v := getenv("NATSHARD_RELEASE_GRACE"); v != "" {
		if err := (*autoFlag)(&c.ReleaseGrace).Set(v); err != nil {
			errs = append(errs, fmt.Errorf("NATSHARD_RELEASE_GRACE: %w", err))
		}
	}
	fs.Var((*autoFlag)(&c.ReleaseGrace), "release-grace", fmt.Sprintf("how long a handoff source keeps diverting after the new owner subscribed (cluster interest propagation); auto: 0 on a standalone NATS server, %s on a cluster [NATSHARD_RELEASE_GRACE]", natshard.ClusterReleaseGrace))
	fs.IntVar(&c.BufferSize, "buffer-size", envInt("NATSHARD_BUFFER_SIZE", natshard.DefaultBufferSize), "messages buffered per shard during a handoff; beyond it they are refused [NATSHARD_BUFFER_SIZE]")
	envBytes := func(name string, def int64) bytesFlag {
		if v := getenv(name); v != "" {
			n, err := parseBytes(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
			}
			return bytesFlag(n)
		}
		return bytesFlag(def)
	}
	c.BucketBytes = envBytes("NATSHARD_BUCKET_BYTES", natshard.DefaultBucketBytes)
	c.BufferBytes = envBytes("NATSHARD_BUFFER_BYTES", natshard.DefaultBufferBytes)
	c.StreamBytes = envBytes("NATSHARD_STREAM_BYTES", natshard.DefaultStreamBytes)
	fs.Var(&c.BucketBytes, "bucket-bytes", "byte limit of the type's KV bucket when it is created, reserved in the JetStream store; entity state is refused before its last sixteenth (kept for leases and the shard table); none: no limit [NATSHARD_BUCKET_BYTES]")
	fs.Var(&c.BufferBytes, "buffer-bytes", "byte limit of the type's handoff buffer stream when it is created, reserved in the JetStream store; beyond it moving shards' messages are refused; none: no limit [NATSHARD_BUFFER_BYTES]")
	fs.Var(&c.StreamBytes, "stream-bytes", "byte limit of a durable type's message stream when it is created, reserved in the JetStream store; beyond it publishes are refused (their acknowledgement says so); none: no limit [NATSHARD_STREAM_BYTES]")
	fs.StringVar(&c.DataPrefix, "data-prefix", env("NATSHARD_DATA_PREFIX", protocol.DefaultDataPrefix), "subject prefix of the data plane [NATSHARD_DATA_PREFIX]")
	fs.StringVar(&c.ControlPrefix, "control-prefix", env("NATSHARD_CONTROL_PREFIX", protocol.DefaultControlPrefix), "subject prefix of the control plane [NATSHARD_CONTROL_PREFIX]")
	fs.StringVar(&c.LogLevel, "log-level", env("NATSHARD_LOG_LEVEL", "info"), "debug, info, warn or error [NATSHARD_LOG_LEVEL]")
	fs.BoolVar(&c.PrintVersion, "version", false, "print the version (module version and VCS revision) and exit")
	fs.StringVar(&c.LogFormat, "log-format", env("NATSHARD_LOG_FORMAT", "text"), "text or json [NATSHARD_LOG_FORMAT]")
	fs.StringVar(&c.HTTP, "http", env("NATSHARD_HTTP", ""), "serve /metrics (Prometheus), /healthz, /readyz and /ui (the live shard map) on this address, like 127.0.0.1:9090 (:9090: every interface); empty serves none [NATSHARD_HTTP]")
	fs.StringVar(&c.AuthDir, "auth-dir", env("NATSHARD_AUTH_DIR", ""), "directory of shardctl auth init: the embedded server runs in operator mode with its accounts, and shardd connects with its region.creds unless --creds [NATSHARD_AUTH_DIR]")
	fs.StringVar(&c.SystemCreds, "system-creds", env("NATSHARD_SYSTEM_CREDS", ""), "credentials of a user of the NATS servers' system account: the coordinator reads their disconnect advisories and finds a dead region at once (the embedded server needs none) [NATSHARD_SYSTEM_CREDS]")
	fs.StringVar(&c.Auth.Creds, "creds", env("NATSHARD_CREDS", ""), "NATS credentials file of a region user (shardctl auth) [NATSHARD_CREDS]")
	fs.StringVar(&c.Auth.TLSCert, "tls-cert", env("NATSHARD_TLS_CERT", ""), "TLS certificate: the embedded server's, or the client certificate for --nats [NATSHARD_TLS_CERT]")
	fs.StringVar(&c.Auth.TLSKey, "tls-key", env("NATSHARD_TLS_KEY", ""), "TLS key of --tls-cert [NATSHARD_TLS_KEY]")
	fs.StringVar(&c.Auth.TLSCA, "tls-ca", env("NATSHARD_TLS_CA", ""), "TLS CA certificates: those that sign the --nats server's, or, for the embedded server, the clients' (which must then present one) [NATSHARD_TLS_CA]")
	if len(errs) > 0 {
		return c, errors.Join(errs...)
	}
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q (shardd takes only flags)", fs.Arg(0))
	}
	for _, r := range strings.Split(routes, ",") {
		if r = strings.TrimSpace(r); r != "" {
			c.Routes = append(c.Routes, r)
		}
	}
	if c.Cluster == "" {
		explicit := getenv("NATSHARD_CLUSTER_NAME") != ""
		fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "cluster_name" || f.Name == "cluster-name" })
		if explicit {
			return c, errors.New("--cluster_name: only with --cluster and --routes (the embedded cluster's name)")
		}
	}
	if c.Remember || c.Kind == entities.DaemonKind {
		// Remembered entities (a daemon's workers are) are never passivated for idleness: the
		// default does not apply, and an explicit value is refused.
		explicit := getenv("NATSHARD_IDLE_TIMEOUT") != ""
		fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "idle-timeout" })
		if !explicit {
			c.IdleTimeout = 0
		} else if c.IdleTimeout > 0 {
			return c, fmt.Errorf("--idle-timeout: %s with %s: remembered entities are not passivated for idleness (they would be started again); leave it out", c.IdleTimeout, rememberFlag(c))
		}
		if c.MaxActive > 0 {
			return c, fmt.Errorf("--max-active: %d with %s: remembered entities are passivated only at their own request; leave it out", c.MaxActive, rememberFlag(c))
		}
	}
	return c, c.Validate()
}

// rememberFlag names what makes c's entities remembered.
func rememberFlag(c config) string {
	if c.Kind == entities.DaemonKind {
		return "--kind daemon (its workers are remembered entities)"
	}
	return "--remember"
}

// Validate checks the configuration and names the field at fault.
func (c *config) Validate() error {
	var errs []error
	switch {
	case c.Workers != 0 && c.Kind != entities.DaemonKind:
		errs = append(errs, fmt.Errorf("--workers: %d with --kind %s: only a daemon (--kind daemon) has workers", c.Workers, c.Kind))
	case c.Workers < 0 || c.Workers > natshard.MaxWorkers:
		errs = append(errs, fmt.Errorf("--workers: %d is out of range 0..%d (0: the stored count)", c.Workers, natshard.MaxWorkers))
	}
	if err := protocol.ValidateName("--type", c.Type); err != nil {
		errs = append(errs, err)
	}
	if err := protocol.ValidateName("--region", c.Region); err != nil {
		errs = append(errs, err)
	}
	if _, err := protocol.NewSubjects(c.DataPrefix, c.ControlPrefix, "t"); err != nil {
		errs = append(errs, fmt.Errorf("--data-prefix/--control-prefix: %w", err))
	}
	if kinds := slices.Concat(entities.Kinds, []string{entities.DaemonKind, sidecar.Kind}); !slices.Contains(kinds, c.Kind) {
		errs = append(errs, fmt.Errorf("--kind: %q is not one of %s", c.Kind, strings.Join(kinds, ", ")))
	}
	switch {
	case c.Kind == sidecar.Kind && c.Sidecar.App == "" && !c.NoRegion:
		errs = append(errs, errors.New("--app: needed with --kind http: the URL of the app that hosts the entities, like http://127.0.0.1:8080"))
	case c.Kind != sidecar.Kind && c.Sidecar.App != "":
		errs = append(errs, fmt.Errorf("--app: only with --kind http (the kind is %q)", c.Kind))
	}
	if c.Delivery != "" && c.Delivery != protocol.DeliveryCore && c.Delivery != protocol.DeliveryDurable {
		errs = append(errs, fmt.Errorf("--delivery: %q is neither core nor durable", c.Delivery))
	}
	if c.RestartRate <= 0 {
		errs = append(errs, fmt.Errorf("--restart-rate: %d is not positive", c.RestartRate))
	}
	if c.Shards < 0 || c.Shards > protocol.MaxShards {
		errs = append(errs, fmt.Errorf("--shards: %d is out of range 0..%d", c.Shards, protocol.MaxShards))
	}
	if c.NoRegion && c.NoCoordinator {
		errs = append(errs, errors.New("--no-region and --no-coordinator: shardd would host nothing"))
	}
	if c.MinRegions < 0 {
		errs = append(errs, fmt.Errorf("--min-regions: %d is negative", c.MinRegions))
	}
	if c.Replicas < 0 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("--replicas: %d is out of range 0..5 (0: auto)", c.Replicas))
	}
	switch {
	case c.NATS != "" && (c.Cluster != "" || len(c.Routes) > 0):
		errs = append(errs, errors.New("--cluster/--routes: make the embedded servers of several shardd one NATS cluster; with --nats no embedded server is started: give one or the other"))
	case c.Cluster == "" && len(c.Routes) > 0:
		errs = append(errs, errors.New("--routes: needs --cluster, the address this shardd's embedded server listens on for the other members' routes (like 0.0.0.0:6222)"))
	case c.Cluster != "" && len(c.Routes) == 0:
		errs = append(errs, errors.New("--cluster: needs --routes, the route URLs of every member, this one's included (like nats-route://host-1:6222,nats-route://host-2:6222,nats-route://host-3:6222)"))
	}
	if c.Cluster != "" {
		if _, port, err := net.SplitHostPort(c.Cluster); err != nil || port == "" {
			errs = append(errs, fmt.Errorf("--cluster: %q is not host:port (like 0.0.0.0:6222)", c.Cluster))
		}
	}
	for _, r := range c.Routes {
		if u, err := url.Parse(r); err != nil || (u.Scheme != "nats-route" && u.Scheme != "nats") || u.Port() == "" {
			errs = append(errs, fmt.Errorf("--routes: %q is not a route URL like nats-route://host:6222", r))
		}
	}
	if c.IdleTimeout < 0 {
		errs = append(errs, fmt.Errorf("--idle-timeout: %s is negative", c.IdleTimeout))
	}
	if c.MaxActive < 0 {
		errs = append(errs, fmt.Errorf("--max-active: %d is negative (0: no limit)", c.MaxActive))
	}
	if err := passivation.Check(c.Passivation); err != nil {
		errs = append(errs, fmt.Errorf("--passivation-policy: %w", err))
	}
	if c.LeaseTTL != auto && (c.LeaseTTL < 2*time.Second || c.LeaseTTL%time.Second != 0) {
		errs = append(errs, fmt.Errorf("--lease-ttl: %s must be whole seconds, at least 2s", c.LeaseTTL))
	}
	if c.StartTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--start-timeout: %s is not positive", c.StartTimeout))
	}
	if c.Strategy != "" {
		if _, canonical, err := strategies.Parse(c.Strategy); err != nil {
			errs = append(errs, fmt.Errorf("--strategy: %w", err))
		} else {
			c.Strategy = canonical
		}
	}
	if c.HandOffTimeout < time.Second {
		errs = append(errs, fmt.Errorf("--handoff-timeout: %s is shorter than 1s", c.HandOffTimeout))
	}
	if c.RebalanceInterval < 0 {
		errs = append(errs, fmt.Errorf("--rebalance-interval: %s is negative", c.RebalanceInterval))
	}
	if c.MaxMoves < 1 {
		errs = append(errs, fmt.Errorf("--max-moves: %d is less than 1", c.MaxMoves))
	}
	if c.ReleaseGrace != auto && (c.ReleaseGrace < 0 || c.ReleaseGrace > 10*time.Second) {
		errs = append(errs, fmt.Errorf("--release-grace: %s is out of range 0..10s", c.ReleaseGrace))
	}
	if c.BufferSize < 1 {
		errs = append(errs, fmt.Errorf("--buffer-size: %d is less than 1", c.BufferSize))
	}
	if c.NATS == "" && c.DataDir == "" {
		errs = append(errs, errors.New("--data-dir: needed for the embedded server"))
	}
	if c.AuthDir != "" && c.Auth.Creds == "" {
		c.Auth.Creds = filepath.Join(c.AuthDir, "region.creds")
	}
	if err := c.Auth.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.NATS == "" && c.Auth.TLSCA != "" && c.Auth.TLSCert == "" {
		errs = append(errs, errors.New("--tls-ca: verifies the clients of the embedded server, which then needs --tls-cert and --tls-key"))
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		errs = append(errs, err)
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		errs = append(errs, fmt.Errorf("--log-format: %q is not text or json", c.LogFormat))
	}
	if c.HTTP != "" {
		if _, port, err := net.SplitHostPort(c.HTTP); err != nil || port == "" {
			errs = append(errs, fmt.Errorf("--http: %q is not host:port (like 127.0.0.1:9090, or :9090 for every interface)", c.HTTP))
		}
	}
	return errors.Join(errs...)
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level: %q is not debug, info, warn or error", s)
	}
	return l, nil
}

// auto is the value of a duration flag set to "auto" (--release-grace,
// --lease-ttl): the library's zero, chosen once the connection tells
// whether the NATS server is part of a cluster. (Not -1: that is
// natshard.Off.)
const auto time.Duration = math.MinInt64

// autoFlag is a duration flag that may also be "auto".
type autoFlag time.Duration

func (g *autoFlag) String() string {
	if time.Duration(*g) == auto {
		return "auto"
	}
	return time.Duration(*g).String()
}

func (g *autoFlag) Set(s string) error {
	if s == "auto" {
		*g = autoFlag(auto)
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is neither auto nor a duration (like 1s)", s)
	}
	*g = autoFlag(d)
	return nil
}
