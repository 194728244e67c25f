package main

import (
	"errors"
	"flag"
	"fmt"
	"github.com/natshard/natshard/region"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// config is shardd's configuration: flags, with NATSHARD_* environment
// variables (and NATS_URL) as defaults.
type config struct {
	NATS          string
	Listen        string
	DataDir       string
	Type          string
	Kind          string
	TraceSubject  string
	Strategy      string // canonical spec, or "" for the stored one
	Shards        int
	Region        string
	Version       string
	NoCoordinator bool
	MinRegions    int
	Replicas      int
	IdleTimeout   time.Duration
	LeaseTTL      time.Duration
	// Handoff and rebalance.
	HandOffTimeout    time.Duration
	RebalanceInterval time.Duration
	MaxMoves          int
	ReleaseGrace      time.Duration
	BufferSize        int
	DataPrefix        string
	ControlPrefix     string
	LogLevel          string
	LogFormat         string
	// Security (docs/SECURITY.md).
	AuthDir string      // embedded server in operator mode; region.creds by default
	Auth    auth.Client // --creds, --tls-*
}

func parseConfig(args []string, getenv func(string) string, stderr io.Writer) (config, error) {
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
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: shardd [flags]\n\nRuns a natshard region (and coordinator candidate). With no NATS URL it starts\nan embedded NATS server with JetStream that other shardd and clients can join.\n\nFlags (environment variable in brackets):\n")
		fs.PrintDefaults()
	}
	fs.StringVar(&c.NATS, "nats", env("NATS_URL", ""), "NATS server URL(s), comma-separated; empty starts an embedded server [NATS_URL]")
	fs.StringVar(&c.Listen, "listen", env("NATSHARD_LISTEN", "127.0.0.1:4222"), "address of the embedded NATS server [NATSHARD_LISTEN]")
	fs.StringVar(&c.DataDir, "data-dir", env("NATSHARD_DATA_DIR", defaultDataDir(getenv)), "JetStream store of the embedded server [NATSHARD_DATA_DIR]")
	fs.StringVar(&c.Type, "type", env("NATSHARD_TYPE", "kv"), "entity type [NATSHARD_TYPE]")
	fs.StringVar(&c.Kind, "kind", env("NATSHARD_KIND", "kv"), "built-in entity kind: kv, echo or trace (diagnostic) [NATSHARD_KIND]")
	fs.StringVar(&c.TraceSubject, "trace-subject", env("NATSHARD_TRACE_SUBJECT", ""), "where trace entities publish their records (default natshard.trace.<type>) [NATSHARD_TRACE_SUBJECT]")
	fs.IntVar(&c.Shards, "shards", envInt("NATSHARD_SHARDS", 0), "shard count; 0 uses the stored count, or 128 for a new type [NATSHARD_SHARDS]")
	fs.StringVar(&c.Region, "region", env("NATSHARD_REGION", defaultRegion()), "region id, unique per process [NATSHARD_REGION]")
	fs.StringVar(&c.Version, "app-version", env("NATSHARD_APP_VERSION", ""), "application version of this process, for rolling updates [NATSHARD_APP_VERSION]")
	fs.BoolVar(&c.NoCoordinator, "no-coordinator", envBool("NATSHARD_NO_COORDINATOR"), "host a region but never take the coordinator lease [NATSHARD_NO_COORDINATOR]")
	fs.IntVar(&c.MinRegions, "min-regions", envInt("NATSHARD_MIN_REGIONS", 1), "allocate no shard before this many regions registered [NATSHARD_MIN_REGIONS]")
	fs.IntVar(&c.Replicas, "replicas", envInt("NATSHARD_REPLICAS", 1), "replicas of the KV bucket when it is created (3 on a cluster) [NATSHARD_REPLICAS]")
	fs.DurationVar(&c.IdleTimeout, "idle-timeout", envDur("NATSHARD_IDLE_TIMEOUT", 120*time.Second), "passivate entities idle this long; 0 never [NATSHARD_IDLE_TIMEOUT]")
	c.LeaseTTL = auto
	if v := getenv("NATSHARD_LEASE_TTL"); v != "" {
		if err := (*autoFlag)(&c.LeaseTTL).Set(v); err != nil {
			errs = append(errs, fmt.Errorf("NATSHARD_LEASE_TTL: %w", err))
		}
	}
	fs.Var((*autoFlag)(&c.LeaseTTL), "lease-ttl", "TTL of the coordinator and region leases, whole seconds; auto: 4s on a standalone NATS server, 15s on a cluster (longer than a JetStream leader election) [NATSHARD_LEASE_TTL]")
	fs.StringVar(&c.Strategy, "strategy", env("NATSHARD_STRATEGY", ""), "allocation strategy, <name>[:<param>=<value>,...]: least-shard (default), legacy-least-shard, consistent-hashing, load-aware; stored per type, a process that disagrees refuses to start [NATSHARD_STRATEGY]")
	fs.DurationVar(&c.HandOffTimeout, "handoff-timeout", envDur("NATSHARD_HANDOFF_TIMEOUT", 10*time.Second), "how long a region may take to pause a shard before it is reallocated [NATSHARD_HANDOFF_TIMEOUT]")
	fs.DurationVar(&c.RebalanceInterval, "rebalance-interval", envDur("NATSHARD_REBALANCE_INTERVAL", 2*time.Second), "time between rebalance rounds; 0 disables them [NATSHARD_REBALANCE_INTERVAL]")
	fs.IntVar(&c.MaxMoves, "max-moves", envInt("NATSHARD_MAX_MOVES", 16), "shard moves in flight at once [NATSHARD_MAX_MOVES]")
	c.ReleaseGrace = auto
	if v := getenv("NATSHARD_RELEASE_GRACE"); v != "" {
		if err := (*autoFlag)(&c.ReleaseGrace).Set(v); err != nil {
			errs = append(errs, fmt.Errorf("NATSHARD_RELEASE_GRACE: %w", err))
		}
	}
	fs.Var((*autoFlag)(&c.ReleaseGrace), "release-grace", "how long a handoff source keeps diverting after the new owner subscribed (cluster interest propagation); auto: 0 on a standalone NATS server, 1s on a cluster [NATSHARD_RELEASE_GRACE]")
	fs.IntVar(&c.BufferSize, "buffer-size", envInt("NATSHARD_BUFFER_SIZE", 100_000), "messages buffered per shard during a handoff; beyond it they are refused [NATSHARD_BUFFER_SIZE]")
	fs.StringVar(&c.DataPrefix, "data-prefix", env("NATSHARD_DATA_PREFIX", protocol.DefaultDataPrefix), "subject prefix of the data plane [NATSHARD_DATA_PREFIX]")
	fs.StringVar(&c.ControlPrefix, "control-prefix", env("NATSHARD_CONTROL_PREFIX", protocol.DefaultControlPrefix), "subject prefix of the control plane [NATSHARD_CONTROL_PREFIX]")
	fs.StringVar(&c.LogLevel, "log-level", env("NATSHARD_LOG_LEVEL", "info"), "debug, info, warn or error [NATSHARD_LOG_LEVEL]")
	fs.StringVar(&c.LogFormat, "log-format", env("NATSHARD_LOG_FORMAT", "text"), "text or json [NATSHARD_LOG_FORMAT]")
	fs.StringVar(&c.AuthDir, "auth-dir", env("NATSHARD_AUTH_DIR", ""), "directory of shardctl auth init: the embedded server runs in operator mode with its accounts, and shardd connects with its region.creds unless --creds [NATSHARD_AUTH_DIR]")
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
	return c, c.Validate()
}

// Validate checks the configuration and names the field at fault.
func (c *config) Validate() error {
	var errs []error
	if err := protocol.ValidateName("--type", c.Type); err != nil {
		errs = append(errs, err)
	}
	if err := protocol.ValidateName("--region", c.Region); err != nil {
		errs = append(errs, err)
	}
	if _, err := protocol.NewSubjects(c.DataPrefix, c.ControlPrefix, "t"); err != nil {
		errs = append(errs, fmt.Errorf("--data-prefix/--control-prefix: %w", err))
	}
	if c.Kind != "kv" && c.Kind != "echo" && c.Kind != "trace" {
		errs = append(errs, fmt.Errorf("--kind: %q is not kv, echo or trace", c.Kind))
	}
	if c.Shards < 0 || c.Shards > protocol.MaxShards {
		errs = append(errs, fmt.Errorf("--shards: %d is out of range 0..%d", c.Shards, protocol.MaxShards))
	}
	if c.MinRegions < 0 {
		errs = append(errs, fmt.Errorf("--min-regions: %d is negative", c.MinRegions))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("--replicas: %d is out of range 1..5", c.Replicas))
	}
	if c.IdleTimeout < 0 {
		errs = append(errs, fmt.Errorf("--idle-timeout: %s is negative", c.IdleTimeout))
	}
	if c.LeaseTTL != auto && (c.LeaseTTL < 2*time.Second || c.LeaseTTL%time.Second != 0) {
		errs = append(errs, fmt.Errorf("--lease-ttl: %s must be whole seconds, at least 2s", c.LeaseTTL))
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
	return errors.Join(errs...)
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level: %q is not debug, info, warn or error", s)
	}
	return l, nil
}

// defaultRegion is hostname-pid, reduced to the characters region ids allow.
func defaultRegion() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "shardd"
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

// defaultDataDir is $XDG_STATE_HOME/natshard, or ~/.local/state/natshard.
func defaultDataDir(getenv func(string) string) string {
	if d := getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "natshard")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return ""
	}
	return filepath.Join(home, ".local", "state", "natshard")
}

// auto is the value of a duration flag set to "auto" (--release-grace,
// --lease-ttl): resolved once the connection tells whether the NATS server
// is part of a cluster.
const auto time.Duration = -1

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

// Lease TTLs of --lease-ttl auto.
const (
	standaloneLeaseTTL = 4 * time.Second
	// clusterLeaseTTL outlives a JetStream leader election (nats-server
	// waits 4-9 s before electing a new leader of a stream whose leader's
	// server died): shorter, every region fences itself whenever the
	// server leading the KV bucket dies.
	clusterLeaseTTL = 15 * time.Second
)

// leaseTTL resolves --lease-ttl for the connection's server.
func leaseTTL(flag time.Duration, clusterName string) time.Duration {
	switch {
	case flag != auto:
		return flag
	case clusterName == "":
		return standaloneLeaseTTL
	}
	return clusterLeaseTTL
}

// releaseGrace resolves --release-grace for the connection's server: auto
// is none on a standalone server (no cluster: the new owner's server is
// every publisher's server, so its subscription is known to all of them
// once Flush returns) and region.DefaultReleaseGrace on a cluster. Regions
// behind different leaf nodes of one hub need an explicit value (see
// docs/OPERATIONS.md): the client cannot see leaf connections. The result
// is for region and coordinator Configs, where 0 means their default and a
// negative duration none.
func releaseGrace(flag time.Duration, clusterName string) time.Duration {
	switch {
	case flag == auto && clusterName == "":
		return -1
	case flag == auto:
		return region.DefaultReleaseGrace
	case flag == 0:
		return -1
	}
	return flag
}
