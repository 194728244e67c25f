package natshard

import (
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/region"
)

// This file holds the node's connection: made or given, the system
// account's beside it, and the watch that suspends the regions while it
// is down.

// connect makes n's connection: Options.Conn, or a new one to
// Options.NATS or to an embedded server. It starts watching its status.
func (n *Node) connect() error {
	o := &n.opts
	if o.Conn != nil {
		n.nc, n.sys = o.Conn, o.SystemConn
		if n.nc.Opts.PingInterval > 5*time.Second || n.nc.Opts.MaxReconnect >= 0 {
			n.log.Warn("Options.Conn was not connected with natshard.ConnectOptions: it may notice a dead server late, or give up reconnecting (the node then stops)",
				"ping_interval", n.nc.Opts.PingInterval.String(), "max_reconnects", n.nc.Opts.MaxReconnect)
		}
	} else {
		url, client := o.NATS, o.auth()
		var extra []nats.Option
		var sys *sysUser
		if url == "" {
			srv, su, err := startServer(o.Server, o.Region, n.log)
			if err != nil {
				return fmt.Errorf("natshard: %w", err)
			}
			n.srv, sys = srv, su
			url = srv.ClientURL()
			n.log.Info("embedded NATS server started", "url", url, "data_dir", o.Server.DataDir,
				"operator_mode", o.Server.AuthDir != "", "tls", o.Server.TLS.Cert != "")
			if o.Server.clustered() {
				// The node's connection learns the other members' client
				// URLs from the cluster (nats.go's discovered servers);
				// its own server only dies with this process.
				members := clusterSize(o.Server)
				n.log.Info("embedded NATS server is a cluster member", "name", srv.Name(), "cluster", srv.ClusterName(),
					"cluster_listen", o.Server.Cluster, "routes", strings.Join(o.Server.Routes, ","), "members", members)
				if members < 3 {
					n.log.Warn("an embedded cluster of fewer than three members stops when any one is lost (JetStream needs a majority): list three in Server.Routes (shardd --routes)", "members", members)
				}
			}
			// The TLS files are the server's; the node connects in
			// process, where the server offers TLS without requiring it.
			client = auth.Client{Creds: o.Creds}
			if o.Server.TLS.Cert != "" {
				extra = append(extra, nats.InProcessServer(srv))
				url = strings.Replace(url, "tls://", "nats://", 1)
			}
		}
		authOpts, err := client.Options()
		if err != nil {
			n.shutdownServer()
			return fmt.Errorf("natshard: %w", err)
		}
		nc, err := nats.Connect(url, append(append(append(authOpts, extra...), ConnectOptions()...),
			nats.Name(o.Name),
			nats.RetryOnFailedConnect(false),
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
				if err != nil { // nil: our own drain or close
					n.log.Warn("disconnected from NATS", "err", err)
				}
			}),
			// Asynchronous errors, permission violations among them.
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { n.log.Warn("NATS error", "err", err) }),
		)...)
		if err != nil {
			n.shutdownServer()
			return fmt.Errorf("natshard: cannot connect to NATS at %s: %w", url, err)
		}
		n.nc, n.ownsConn = nc, true
		if err := n.connectSystem(url, sys, extra); err != nil {
			n.closeConn()
			n.shutdownServer()
			return err
		}
	}
	if n.sys != nil {
		n.disconnect = coordinator.DisconnectAdvisories(n.sys)
	}
	js, err := jetstream.New(n.nc)
	if err != nil {
		n.closeConn()
		n.shutdownServer()
		return fmt.Errorf("natshard: %w", err)
	}
	n.js = js
	n.status = n.nc.StatusChanged(nats.RECONNECTING, nats.CONNECTED, nats.CLOSED)
	go n.watchConn()
	return nil
}

// connectSystem connects to the system account, where the servers publish
// their disconnect advisories: to the embedded server with its system user
// (in process), or to url with Options.SystemCreds; not at all otherwise.
func (n *Node) connectSystem(url string, su *sysUser, extra []nats.Option) error {
	o := &n.opts
	var opts []nats.Option
	switch {
	case o.SystemConn != nil:
		n.sys = o.SystemConn
		return nil
	case su != nil:
		opts = []nats.Option{nats.UserInfo(su.name, su.password), nats.InProcessServer(n.srv)}
	case o.SystemCreds != "":
		c := o.auth()
		c.Creds = o.SystemCreds
		var err error
		if opts, err = c.Options(); err != nil {
			return fmt.Errorf("natshard: SystemCreds: %w", err)
		}
		opts = append(opts, extra...)
	default:
		return nil
	}
	sys, err := nats.Connect(url, append(append(opts, ConnectOptions()...), nats.Name(o.Name+" (system)"))...)
	if err != nil {
		return fmt.Errorf("natshard: cannot connect to the system account of NATS at %s: %w", url, err)
	}
	n.sys, n.ownsSys = sys, true
	return nil
}

// watchConn suspends every region when the connection drops: nats.go
// subscribes again on reconnect, and the coordinator may have moved a
// shard meanwhile, so a region serves nothing (it holds what arrives)
// until it has confirmed its shards once reconnected (region.Agent.Suspend).
// A closed connection ends the node.
func (n *Node) watchConn() {
	defer close(n.watchDone)
	for st := range n.status {
		switch st {
		case nats.RECONNECTING:
			n.eachAgent(func(a *region.Agent) { a.Suspend("disconnected from NATS") })
		case nats.CONNECTED:
			n.log.Info("reconnected to NATS", "url", n.nc.ConnectedUrl())
			n.eachAgent((*region.Agent).Reconnected)
		case nats.CLOSED:
			n.fence("the NATS connection is closed")
			n.finish(ErrConnectionClosed)
		}
	}
}

func (n *Node) fence(why string) { n.eachAgent(func(a *region.Agent) { a.Fence(why) }) }

// eachAgent calls f with the region agent of every hosted type that has one.
func (n *Node) eachAgent(f func(*region.Agent)) {
	for _, h := range n.hostedTypes() {
		if h.agent != nil {
			f(h.agent)
		}
	}
}
