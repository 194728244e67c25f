package main

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// startEmbedded starts a NATS server with JetStream on listen, storing in
// dir. Its short ping interval lets it notice a silently dead client in
// about 6 seconds instead of the default 4 minutes (DESIGN.md 6).
func startEmbedded(listen, dir string) (*server.Server, error) {
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("--listen: %q is not host:port: %w", listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("--listen: port %q is not a number", portStr)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("--data-dir: %w", err)
	}
	opts := &server.Options{
		ServerName:             "natshard-embedded",
		Host:                   host,
		Port:                   port,
		JetStream:              true,
		StoreDir:               dir,
		PingInterval:           2 * time.Second,
		MaxPingsOut:            3,
		NoSigs:                 true,
		NoLog:                  true,
		DisableJetStreamBanner: true,
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded NATS server: %w", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("embedded NATS server did not start listening on %s (is the port in use? pass --nats to join a running server)", listen)
	}
	return s, nil
}
