package natshard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// The embedded cluster: the embedded servers of several processes joined
// by NATS routes into one NATS cluster with JetStream on every member
// (ServerOptions.Cluster and Routes, nats-server's --cluster and
// --routes). docs/OPERATIONS.md, "An embedded cluster".

// DefaultClusterName is the embedded cluster's name when
// ServerOptions.ClusterName is empty.
const DefaultClusterName = "natshard"

// serverNameFile, in the data directory, keeps the name of a clustered
// embedded server: JetStream knows its peers by their server names, so a
// member restarted on its data directory must come back under its name.
const serverNameFile = "natshard-server-name"

// lameDuck bounds how long a clustered embedded server takes to leave the
// cluster when its node stops: it hands the leadership of its JetStream
// assets to the other members first (nats-server's lame duck mode), so
// that they need not wait for an election.
const (
	lameDuck      = 3 * time.Second
	lameDuckGrace = time.Second
)

// clustered reports whether o configures an embedded cluster member.
func (o *ServerOptions) clustered() bool { return o.Cluster != "" || len(o.Routes) > 0 }

// validateCluster checks the cluster fields of o and names the field at
// fault.
func (o *ServerOptions) validateCluster() []error {
	var errs []error
	switch {
	case o.Cluster == "" && len(o.Routes) > 0:
		errs = append(errs, errors.New("Server.Routes: needs Server.Cluster, the address this server listens on for the other members' routes"))
	case o.Cluster != "" && len(o.Routes) == 0:
		errs = append(errs, errors.New("Server.Cluster: needs Server.Routes, the route URLs of the cluster's members (every member's, this one's included)"))
	}
	if o.Cluster != "" {
		if _, _, err := splitHostPort(o.Cluster); err != nil {
			errs = append(errs, fmt.Errorf("Server.Cluster: %w", err))
		}
	}
	for _, r := range o.Routes {
		if _, err := parseRoute(r); err != nil {
			errs = append(errs, fmt.Errorf("Server.Routes: %w", err))
		}
	}
	if o.ClusterName != "" && strings.ContainsAny(o.ClusterName, " \t\r\n") {
		errs = append(errs, fmt.Errorf("Server.ClusterName: %q has white space", o.ClusterName))
	}
	if o.Name != "" && strings.ContainsAny(o.Name, " \t\r\n") {
		errs = append(errs, fmt.Errorf("Server.Name: %q has white space", o.Name))
	}
	return errs
}

// parseRoute parses a route URL: nats-route://host:port (nats:// is taken
// too, as nats-server takes it).
func parseRoute(r string) (*url.URL, error) {
	u, err := url.Parse(strings.TrimSpace(r))
	if err != nil {
		return nil, fmt.Errorf("%q is not a URL: %w", r, err)
	}
	if u.Scheme != "nats-route" && u.Scheme != "nats" {
		return nil, fmt.Errorf("%q is not a route URL like nats-route://host:6222", r)
	}
	if u.Hostname() == "" || u.Port() == "" {
		return nil, fmt.Errorf("%q has no host:port (like nats-route://host:6222)", r)
	}
	return u, nil
}

// splitHostPort splits a listen address and checks its port.
func splitHostPort(addr string) (string, int, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("%q is not host:port: %w", addr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("port %q is not a port number", portStr)
	}
	return host, port, nil
}

// configureCluster makes opts a member of o's embedded cluster: route
// listener, routes, cluster name, and a server name that is unique and
// stable across restarts on the data directory (JetStream knows its peers
// by it). region names a first start's server.
func configureCluster(opts *server.Options, o ServerOptions, region string) error {
	host, port, err := splitHostPort(o.Cluster)
	if err != nil {
		return fmt.Errorf("Server.Cluster: %w", err)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	opts.Cluster.Host, opts.Cluster.Port = host, port
	opts.Cluster.Name = o.ClusterName
	if opts.Cluster.Name == "" {
		opts.Cluster.Name = DefaultClusterName
	}
	for _, r := range o.Routes {
		u, err := parseRoute(r)
		if err != nil {
			return fmt.Errorf("Server.Routes: %w", err)
		}
		opts.Routes = append(opts.Routes, u)
	}
	name, err := serverName(o, region)
	if err != nil {
		return err
	}
	opts.ServerName = name
	opts.LameDuckDuration, opts.LameDuckGracePeriod = lameDuck, lameDuckGrace
	// A route to a member that is down is retried every second: say so
	// on the first attempt and once a minute, not at every attempt
	// (nats-server's default for a route that had connected).
	opts.ReconnectErrorReports = 60
	return nil
}

// serverName is the clustered embedded server's name: Server.Name if set,
// else the one stored in the data directory, else (a first start)
// "natshard-<region>", stored there.
func serverName(o ServerOptions, region string) (string, error) {
	file := filepath.Join(o.DataDir, serverNameFile)
	stored, err := os.ReadFile(file)
	switch {
	case err == nil && strings.TrimSpace(string(stored)) != "":
		name := strings.TrimSpace(string(stored))
		if o.Name != "" && o.Name != name {
			return "", fmt.Errorf("Server.Name: %q, but the data directory %s belongs to the server %q (%s): JetStream knows its peers by name; give that name, or another data directory", o.Name, o.DataDir, name, file)
		}
		return name, nil
	case err != nil && !errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("Server.DataDir: %w", err)
	}
	name := o.Name
	if name == "" {
		name = "natshard-" + region
	}
	if err := os.WriteFile(file, []byte(name+"\n"), 0o640); err != nil {
		return "", fmt.Errorf("Server.DataDir: keep the server's name: %w", err)
	}
	return name, nil
}

// clusterSize is the number of members o's routes name: the distinct
// routes, plus this server when none of them is recognisably its own
// (the same port as Server.Cluster, on an address of this machine). As
// nats-server's documentation advises, every member may list every
// member, itself included.
func clusterSize(o ServerOptions) int {
	_, port, _ := splitHostPort(o.Cluster)
	seen := map[string]bool{}
	self := false
	for _, r := range o.Routes {
		u, err := parseRoute(r)
		if err != nil || seen[u.Host] {
			continue
		}
		seen[u.Host] = true
		if u.Port() == strconv.Itoa(port) && isLocal(u.Hostname()) {
			self = true
		}
	}
	if !self {
		return len(seen) + 1
	}
	return len(seen)
}

// isLocal reports whether host names an address of this machine; a name
// that does not resolve (a peer not started yet) is not.
func isLocal(host string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return false
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, ip := range ips {
		if ip.IP.IsLoopback() {
			return true
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip.IP) {
				return true
			}
		}
	}
	return false
}

// clusterReplicas is the replica count of a type with zero Replicas on
// o's embedded cluster: the cluster's size, at most 3.
func clusterReplicas(o ServerOptions) int { return min(clusterSize(o), 3) }

// jetStreamCurrent says why the embedded server's JetStream is not current
// with the cluster (its meta group and every stream and consumer it holds
// a replica of caught up: nats-server's /healthz), or nil when it is, or
// when the node has no clustered embedded server.
func (n *Node) jetStreamCurrent() error {
	if n.srv == nil || !n.opts.Server.clustered() {
		return nil
	}
	h := n.srv.Healthz(nil)
	if h == nil || h.StatusCode == 0 || h.StatusCode == 200 {
		return nil
	}
	why := h.Error
	if why == "" {
		why = h.Status
	}
	return fmt.Errorf("the embedded NATS server's JetStream is not current with the cluster yet: %s", why)
}

// serverLog passes a clustered embedded server's log on to the node's
// logger (component=nats-server): its warnings and errors (a route that
// cannot connect, a JetStream catch-up that failed) at WARN, its notices
// (routes made, leaders elected) at DEBUG. A standalone embedded server
// logs nothing, as before.
type serverLog struct{ l *slog.Logger }

func (s serverLog) Noticef(format string, v ...any) { s.l.Debug(fmt.Sprintf(format, v...)) }
func (s serverLog) Warnf(format string, v ...any) {
	if msg := fmt.Sprintf(format, v...); !strings.HasPrefix(msg, "Plaintext passwords detected") {
		s.l.Warn(msg) // (the system user's password is made in process, and never leaves it)
	}
}
func (s serverLog) Errorf(format string, v ...any) { s.l.Warn(fmt.Sprintf(format, v...)) }
func (s serverLog) Fatalf(format string, v ...any) { s.l.Error(fmt.Sprintf(format, v...)) }
func (s serverLog) Debugf(format string, v ...any) {}
func (s serverLog) Tracef(format string, v ...any) {}
