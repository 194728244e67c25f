// Command shardd runs a natshard region and coordinator candidate for one
// entity type, with built-in entity kinds (kv, echo). With no NATS URL it
// starts an embedded NATS server with JetStream.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
	"github.com/natshard/natshard/strategies"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// A second signal forces exit.
		<-ctx.Done()
		stop()
		c := make(chan os.Signal, 1)
		signal.Notify(c, os.Interrupt, syscall.SIGTERM)
		<-c
		fmt.Fprintln(os.Stderr, "shardd: second signal, exiting at once")
		os.Exit(2)
	}()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "shardd:", err)
		os.Exit(1)
	}
}

// run starts shardd and blocks until ctx ends, then shuts down gracefully:
// the region leaves (the coordinator hands its shards off, for at most
// 30s), stops serving and deregisters (entities persist), the coordinator
// lease is released, the connection drained.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := parseConfig(args, getenv, stderr)
	if err != nil {
		return err
	}
	level, _ := parseLevel(cfg.LogLevel)
	var handler slog.Handler = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})
	if cfg.LogFormat == "json" {
		handler = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})
	}
	log := slog.New(handler).With("type", cfg.Type)

	url := cfg.NATS
	client := cfg.Auth
	var extra []nats.Option
	if url == "" {
		srv, err := startEmbedded(cfg)
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		url = srv.ClientURL()
		log.Info("embedded NATS server started", "url", url, "data_dir", cfg.DataDir, "operator_mode", cfg.AuthDir != "", "tls", cfg.Auth.TLSCert != "")
		// The TLS files are the server's; shardd itself connects in process.
		client = auth.Client{Creds: cfg.Auth.Creds}
		if cfg.Auth.TLSCert != "" {
			// In process, the server offers TLS without requiring it.
			extra = append(extra, nats.InProcessServer(srv))
			url = strings.Replace(url, "tls://", "nats://", 1)
		}
	}
	authOpts, err := client.Options()
	if err != nil {
		return err
	}

	// The region is created after the connection; the disconnect handler
	// reaches it through this variable.
	var agentMu sync.Mutex
	var agent *region.Agent
	nc, err := nats.Connect(url, append(append(authOpts, extra...),
		nats.Name("shardd "+cfg.Region),
		nats.PingInterval(2*time.Second), // notice a dead server in seconds (DESIGN.md 6)
		nats.MaxPingsOutstanding(2),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(500*time.Millisecond),
		nats.RetryOnFailedConnect(false),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err == nil {
				return // our own drain or close
			}
			log.Warn("disconnected from NATS", "err", err)
			agentMu.Lock()
			defer agentMu.Unlock()
			if agent != nil {
				agent.Fence("disconnected from NATS")
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { log.Info("reconnected to NATS", "url", c.ConnectedUrl()) }),
		// Asynchronous errors, permission violations among them.
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("NATS error", "err", err) }),
	)...)
	if err != nil {
		return fmt.Errorf("cannot connect to NATS at %s: %w", url, err)
	}
	defer nc.Close()

	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	store, err := kvstate.Open(ctx, js, cfg.Type, kvstate.Options{Replicas: cfg.Replicas})
	if err != nil {
		return fmt.Errorf("open KV bucket of type %q: %w", cfg.Type, err)
	}
	// A bucket just created on a cluster may still be electing its leader:
	// retry what is only unavailable, for a while.
	var typeCfg protocol.TypeConfig
	for attempt := 1; ; attempt++ {
		typeCfg, err = ensureConfig(ctx, store, cfg.Shards, cfg.Strategy)
		if !errors.Is(err, kvstate.ErrUnavailable) || attempt == 30 || ctx.Err() != nil {
			break
		}
		log.Warn("type configuration not readable yet; retrying", "attempt", attempt, "err", err)
		time.Sleep(2 * time.Second)
	}
	if err != nil {
		return err
	}
	shards := typeCfg.Shards
	strategy, _, err := strategies.Parse(typeCfg.Strategy)
	if err != nil {
		return fmt.Errorf("the type's stored strategy: %w", err)
	}
	subjects, err := protocol.NewSubjects(cfg.DataPrefix, cfg.ControlPrefix, cfg.Type)
	if err != nil {
		return err
	}
	buffer, err := kvstate.OpenBuffer(ctx, js, subjects, kvstate.BufferOptions{Replicas: cfg.Replicas, MaxPerShard: int64(cfg.BufferSize), Logger: log})
	if err != nil {
		return fmt.Errorf("open the handoff buffer of type %q: %w", cfg.Type, err)
	}
	var factory region.Factory
	switch cfg.Kind {
	case "kv":
		factory = entities.KV(store)
	case "echo":
		factory = entities.Echo()
	case "trace":
		subject := cfg.TraceSubject
		if subject == "" {
			subject = "natshard.trace." + cfg.Type
		}
		factory = entities.Trace(nc.Publish, subject, cfg.Region)
	}
	grace := releaseGrace(cfg.ReleaseGrace, nc.ConnectedClusterName())
	cfg.LeaseTTL = leaseTTL(cfg.LeaseTTL, nc.ConnectedClusterName())
	log.Info("release grace and lease TTL", "grace", max(grace, 0), "lease_ttl", cfg.LeaseTTL, "cluster", nc.ConnectedClusterName())
	a, err := region.Open(ctx, region.Config{
		Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, ID: cfg.Region, Version: cfg.Version,
		Factory: factory, IdleTimeout: idleOrNever(cfg.IdleTimeout), LeaseTTL: cfg.LeaseTTL, Logger: log,
		ReleaseGrace: grace, MaxHeld: cfg.BufferSize,
	})
	if err != nil {
		return err
	}
	agentMu.Lock()
	agent = a
	agentMu.Unlock()

	coordCtx, stopCoord := context.WithCancel(context.WithoutCancel(ctx))
	coordDone := make(chan struct{})
	if cfg.NoCoordinator {
		close(coordDone)
	} else {
		node := coordinator.New(coordinator.Config{
			Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: cfg.Region, Strategy: strategy,
			MinRegions: cfg.MinRegions, LeaseTTL: cfg.LeaseTTL, Logger: log,
			HandOffTimeout: cfg.HandOffTimeout, RebalanceInterval: rebalanceOrNever(cfg.RebalanceInterval),
			MaxMoves: cfg.MaxMoves, ReleaseGrace: grace,
		})
		go func() {
			defer close(coordDone)
			if err := node.Run(coordCtx); err != nil {
				log.Error("coordinator stopped", "err", err)
			}
		}()
	}
	log.Info("shardd running", "region", cfg.Region, "kind", cfg.Kind, "shards", shards, "strategy", typeCfg.Strategy, "nats", url, "coordinator_candidate", !cfg.NoCoordinator)

	<-ctx.Done()
	log.Info("shutting down: leaving, waiting for the shards to be handed off")
	lctx, cancelLeave := context.WithTimeout(context.Background(), 30*time.Second)
	if !nc.IsConnected() {
		log.Warn("not connected to NATS: the shards are not handed off", "shards", len(a.Held()))
	} else if _, _, err := store.Coordinator(lctx); errors.Is(err, kvstate.ErrNotFound) {
		log.Warn("no coordinator is running: the shards are not handed off; messages sent to them are lost until a coordinator re-homes them", "shards", len(a.Held()))
	} else if err := a.Leave(lctx); err != nil {
		log.Warn("shards not all handed off in time; the coordinator re-homes the rest as after a crash", "err", err, "shards", a.Held())
	}
	cancelLeave()
	sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := a.Close(sctx); err != nil {
		log.Warn("region close", "err", err)
	}
	stopCoord()
	<-coordDone
	if err := nc.Drain(); err != nil {
		log.Warn("drain", "err", err)
	}
	for !nc.IsClosed() && sctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	log.Info("stopped")
	return nil
}

// ensureConfig returns the type's configuration: the stored one, which
// the flags (when given: a non-zero shard count, a strategy) must match, or
// the flags' (with the defaults, 128 shards and least-shard) for a new type.
func ensureConfig(ctx context.Context, store *kvstate.Store, flagShards int, flagStrategy string) (protocol.TypeConfig, error) {
	want := protocol.TypeConfig{Shards: flagShards, Strategy: flagStrategy}
	stored, err := store.Config(ctx)
	switch {
	case errors.Is(err, kvstate.ErrNotFound):
		if want.Shards == 0 {
			want.Shards = protocol.DefaultShards
		}
		if want.Strategy == "" {
			want.Strategy = strategies.DefaultSpec
		}
	case err != nil:
		return stored, fmt.Errorf("read type configuration: %w", err)
	default:
		if want.Shards == 0 {
			want.Shards = stored.Shards
		}
	}
	got, err := store.EnsureConfig(ctx, want)
	if errors.Is(err, kvstate.ErrConfigMismatch) {
		switch {
		case got.Shards != want.Shards:
			return got, fmt.Errorf("--shards %d disagrees with the type's stored shard count %d; the shard count of a type cannot change while it has data (%w)", want.Shards, got.Shards, err)
		default:
			return got, fmt.Errorf("--strategy %q disagrees with the type's stored strategy %q; every process of a type must use the same strategy (%w)", want.Strategy, got.Strategy, err)
		}
	}
	if err != nil {
		return got, fmt.Errorf("store type configuration: %w", err)
	}
	if got.Strategy == "" {
		got.Strategy = strategies.DefaultSpec // a bucket from before strategies were stored
	}
	return got, nil
}

func rebalanceOrNever(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

func idleOrNever(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
