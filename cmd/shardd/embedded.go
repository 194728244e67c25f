package main

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard/auth"
)

// startEmbedded starts a NATS server with JetStream on cfg.Listen, storing
// in cfg.DataDir. Its short ping interval lets it notice a silently dead
// client in about 6 seconds instead of the default 4 minutes (DESIGN.md 6).
// With --auth-dir it runs in operator mode with the directory's accounts in
// a memory resolver; with --tls-cert it requires TLS from its clients, and
// with --tls-ca also a client certificate signed by that CA.
func startEmbedded(cfg config) (*server.Server, error) {
	host, portStr, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("--listen: %q is not host:port: %w", cfg.Listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("--listen: port %q is not a number", portStr)
	}
	if err := os.MkdirAll(cfg.DataDir, 0o750); err != nil {
		return nil, fmt.Errorf("--data-dir: %w", err)
	}
	opts := &server.Options{
		ServerName:             "natshard-embedded",
		Host:                   host,
		Port:                   port,
		JetStream:              true,
		StoreDir:               cfg.DataDir,
		PingInterval:           2 * time.Second,
		MaxPingsOut:            3,
		NoSigs:                 true,
		NoLog:                  true,
		DisableJetStreamBanner: true,
	}
	if cfg.AuthDir != "" {
		st, err := auth.Load(cfg.AuthDir)
		if err != nil {
			return nil, fmt.Errorf("--auth-dir: %w", err)
		}
		if err := st.ConfigureServer(opts); err != nil {
			return nil, fmt.Errorf("--auth-dir: %w", err)
		}
	}
	if cfg.Auth.TLSCert != "" {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
			CertFile: cfg.Auth.TLSCert, KeyFile: cfg.Auth.TLSKey, CaFile: cfg.Auth.TLSCA, Verify: cfg.Auth.TLSCA != "",
		})
		if err != nil {
			return nil, fmt.Errorf("--tls-cert/--tls-key/--tls-ca: %w", err)
		}
		opts.TLS, opts.TLSConfig, opts.TLSVerify, opts.TLSTimeout = true, tc, cfg.Auth.TLSCA != "", 2
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded NATS server: %w", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("embedded NATS server did not start listening on %s (is the port in use? pass --nats to join a running server)", cfg.Listen)
	}
	return s, nil
}
