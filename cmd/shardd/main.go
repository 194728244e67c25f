// Command shardd runs a natshard region and coordinator candidate for one
// entity type, with a built-in entity kind (kv, echo, trace) or with
// entities in an HTTP app of any language (--kind http --app URL). With no
// NATS URL it starts an embedded NATS server with JetStream. It is the
// thinnest user of package natshard: flags and environment to
// natshard.Options and natshard.Type, then natshard.Start and Node.Serve
// (sidecar.Run for --kind http), with package web on --http and
// OpenTelemetry from the OTEL_* variables.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/otelenv"
	"github.com/natshard/natshard/internal/version"
	"github.com/natshard/natshard/sidecar"
	"github.com/natshard/natshard/web"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
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
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "shardd:", err)
		os.Exit(1)
	}
}

// run hosts the configured type until ctx ends, then stops gracefully:
// the region leaves (its shards are handed off, for at most
// natshard.LeaveTimeout), its entities stop, the lease is released, the
// connection drained. With --http it serves package web's endpoints from
// before the node starts until it stopped; with OTEL_* variables it traces
// (internal/otelenv).
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cfg, err := parseConfig(args, getenv, stdout)
	if err != nil {
		return err
	}
	if cfg.PrintVersion {
		fmt.Fprintln(stdout, version.String("shardd"))
		return nil
	}
	log := newLogger(cfg, stderr)
	opts, typ, err := cfg.natshard(log)
	if err != nil {
		return err
	}
	tracing, err := otelenv.FromEnv(ctx, "shardd", cfg.Region)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tracing.Shutdown(sctx); err != nil {
			log.Warn("flushing the traces", "err", err)
		}
	}()
	if tracing.Provider != nil {
		opts.TracerProvider = tracing.Provider
		log.Info("tracing: spans go to an OTLP collector", "endpoint", tracing.Endpoint)
	}
	var handler *web.Handler
	if cfg.HTTP != "" {
		// The listener comes first, so that /healthz and /readyz answer
		// (503, starting) while the node connects and registers, and say
		// what the start waits for while JetStream is unavailable.
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), collectors.NewBuildInfoCollector())
		opts.Metrics = reg
		handler = web.New(nil, web.Options{Gatherer: reg, Logger: log})
		opts.OnStartWait = handler.SetStartWait // /readyz says what the start waits for
		stop, err := serveHTTP(cfg.HTTP, handler, log)
		if err != nil {
			return err
		}
		defer stop()
	}
	if cfg.Kind == sidecar.Kind && !cfg.NoRegion {
		if handler != nil {
			cfg.Sidecar.Started = handler.SetNode
		}
		return sidecar.Run(ctx, opts, cfg.Sidecar, typ)
	}
	node, err := natshard.Start(ctx, opts, typ)
	if err != nil {
		return err
	}
	if handler != nil {
		handler.SetNode(node)
	}
	return node.Serve(ctx)
}

// serveHTTP serves h on addr until stop is called (after the node
// stopped: /readyz says it is stopping meanwhile).
func serveHTTP(addr string, h http.Handler, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--http: %w", err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("HTTP listener stopped", "err", err)
		}
	}()
	log.Info("HTTP listening: /metrics, /healthz, /readyz, /ui/", "addr", ln.Addr().String())
	return func() {
		// The shard map's event streams do not end by themselves: give the
		// requests a moment, then close what is left.
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if srv.Shutdown(ctx) != nil {
			_ = srv.Close()
		}
		<-done
	}, nil
}

// natshard maps the configuration onto the library's.
func (c config) natshard(log *slog.Logger) (natshard.Options, natshard.Type, error) {
	var entity natshard.Factory // --kind http: the sidecar's, or none with --no-region
	if c.Kind != sidecar.Kind && c.Kind != entities.DaemonKind {
		var err error
		if entity, err = entities.Kind(c.Kind, c.TraceSubject); err != nil {
			return natshard.Options{}, natshard.Type{}, err
		}
	}
	tls := natshard.TLSFiles{Cert: c.Auth.TLSCert, Key: c.Auth.TLSKey, CA: c.Auth.TLSCA}
	opts := natshard.Options{
		NATS: c.NATS, Creds: c.Auth.Creds, SystemCreds: c.SystemCreds,
		Server: natshard.ServerOptions{Listen: c.Listen, DataDir: c.DataDir, AuthDir: c.AuthDir,
			Cluster: c.Cluster, Routes: c.Routes, ClusterName: c.ClusterName},
		Region: c.Region, Name: "shardd " + c.Region, Version: c.Version, NoCoordinator: c.NoCoordinator, NoRegion: c.NoRegion,
		LeaseTTL: autoZero(c.LeaseTTL), StartTimeout: c.StartTimeout, ReleaseGrace: autoZero(offZero(c.ReleaseGrace)),
		DataPrefix: c.DataPrefix, ControlPrefix: c.ControlPrefix, Logger: log,
	}
	if c.Cluster == "" {
		opts.Server.ClusterName = "" // the library's default; no cluster
	}
	if c.NATS == "" {
		opts.Server.TLS = tls // the embedded server's
	} else {
		opts.TLS = tls
	}
	typ := natshard.Type{
		Name: c.Type, Kind: c.Kind, Entity: entity, Shards: c.Shards, Strategy: c.Strategy, Delivery: natshard.Delivery(c.Delivery), Replicas: c.Replicas,
		IdleTimeout: offZero(c.IdleTimeout), MaxActive: c.MaxActive, PassivationPolicy: c.Passivation, HandOffTimeout: c.HandOffTimeout, RebalanceInterval: offZero(c.RebalanceInterval),
		MaxMoves: c.MaxMoves, BufferSize: c.BufferSize, MinRegions: c.MinRegions, Remember: c.Remember, RestartRate: c.RestartRate,
		BucketBytes: int64(c.BucketBytes), BufferBytes: int64(c.BufferBytes), StreamBytes: int64(c.StreamBytes),
	}
	if c.Kind == entities.DaemonKind {
		// The daemon's type, with the flags' knobs; its strategy unless
		// --strategy names one, remembered, never passivated.
		d := natshard.Daemon{Name: c.Type, Workers: c.Workers, Run: entities.Daemon(c.TraceSubject)}.Type()
		d.Kind, d.Shards, d.Delivery, d.Replicas = typ.Kind, typ.Shards, typ.Delivery, typ.Replicas
		d.HandOffTimeout, d.RebalanceInterval, d.MaxMoves, d.BufferSize = typ.HandOffTimeout, typ.RebalanceInterval, typ.MaxMoves, typ.BufferSize
		d.MinRegions, d.RestartRate = typ.MinRegions, typ.RestartRate
		d.BucketBytes, d.BufferBytes, d.StreamBytes = typ.BucketBytes, typ.BufferBytes, typ.StreamBytes
		if typ.Strategy != "" {
			d.Strategy = typ.Strategy
		}
		typ = d
	}
	return opts, typ, nil
}

// offZero maps shardd's 0 ("never", "none") onto the library's Off.
func offZero(d time.Duration) time.Duration {
	if d == 0 {
		return natshard.Off
	}
	return d
}

// autoZero maps shardd's auto onto the library's zero (chosen from the
// server).
func autoZero(d time.Duration) time.Duration {
	if d == auto {
		return 0
	}
	return d
}

func newLogger(c config, stderr io.Writer) *slog.Logger {
	level, _ := parseLevel(c.LogLevel)
	var handler slog.Handler = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})
	if c.LogFormat == "json" {
		handler = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level, ReplaceAttr: readableDurations})
	}
	return slog.New(handler)
}

// readableDurations writes a time.Duration as "1.5s" instead of the
// integer nanoseconds of slog's JSON handler, whoever logged it.
func readableDurations(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}
