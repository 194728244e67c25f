package natshard

import (
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/auth"
)

// startServer starts the embedded NATS server with JetStream. Its short
// ping interval lets it notice a silently dead client in about 6 seconds
// instead of the default 4 minutes (docs/OPERATIONS.md, "NATS settings
// natshard relies on"). With AuthDir it runs in operator mode with the
// directory's accounts in a memory resolver; with TLS.Cert it requires TLS
// from its clients, and with TLS.CA also a client certificate signed by
// that CA.
//
// Without AuthDir it also has a system account with one user, whose
// password is made here and returned: the node connects with it in
// process to read the servers' disconnect advisories (the user without
// credentials, every other client, is in the global account as before).
//
// With Cluster and Routes it is a member of an embedded cluster
// (cluster.go), named after region on its first start, and logs its
// warnings to log.
func startServer(o ServerOptions, region string, log *slog.Logger) (*server.Server, *sysUser, error) {
	host, port, err := splitHostPort(o.Listen)
	if err != nil {
		return nil, nil, fmt.Errorf("Server.Listen: %w", err)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	if err := os.MkdirAll(o.DataDir, 0o750); err != nil {
		return nil, nil, fmt.Errorf("Server.DataDir: %w", err)
	}
	opts := &server.Options{
		ServerName:             "natshard-embedded",
		Host:                   host,
		Port:                   port,
		JetStream:              true,
		StoreDir:               o.DataDir,
		PingInterval:           pingInterval,
		MaxPingsOut:            3,
		NoSigs:                 true,
		NoLog:                  true,
		DisableJetStreamBanner: true,
	}
	if o.clustered() {
		if err := configureCluster(opts, o, region); err != nil {
			return nil, nil, err
		}
	}
	var sys *sysUser
	if o.AuthDir == "" {
		sys = &sysUser{name: "natshard-system", password: nuid.Next()}
		acc := server.NewAccount("SYS")
		opts.Accounts, opts.SystemAccount = []*server.Account{acc}, acc.Name
		opts.Users = []*server.User{
			{Username: sys.name, Password: sys.password, Account: acc},
			{Username: "natshard"}, // the global account, for clients without credentials
		}
		opts.NoAuthUser = "natshard"
	} else {
		st, err := auth.Load(o.AuthDir)
		if err != nil {
			return nil, nil, fmt.Errorf("Server.AuthDir: %w", err)
		}
		if err := st.ConfigureServer(opts); err != nil {
			return nil, nil, fmt.Errorf("Server.AuthDir: %w", err)
		}
	}
	if o.TLS.Cert != "" {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
			CertFile: o.TLS.Cert, KeyFile: o.TLS.Key, CaFile: o.TLS.CA, Verify: o.TLS.CA != "",
		})
		if err != nil {
			return nil, nil, fmt.Errorf("Server.TLS: %w", err)
		}
		opts.TLS, opts.TLSConfig, opts.TLSVerify, opts.TLSTimeout = true, tc, o.TLS.CA != "", 2
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, nil, fmt.Errorf("embedded NATS server: %w", err)
	}
	if o.clustered() {
		s.SetLogger(serverLog{log.With("component", "nats-server")}, false, false)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, nil, fmt.Errorf("embedded NATS server did not start listening on %s (is the port in use? give a NATS URL to join a running server)", o.Listen)
	}
	return s, sys, nil
}

// sysUser is the embedded server's system account user.
type sysUser struct{ name, password string }
