package benchlab

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nuid"
)

// Server is the NATS server a System runs on: embedded (one, or a
// cluster), or one given by its URL. shardctl bench gives each delivery
// mode it measures a System of its own on one Server, one after the other.
type Server struct {
	url  string           // the client URLs, comma-separated
	srvs []*server.Server // none with --nats
	dir  string           // the embedded servers' stores
	// sys is the password of the embedded servers' system account user
	// (benchSysUser): the coordinator reads the servers' disconnect
	// advisories with it, as shardd does on its embedded server.
	sys string
}

// benchSysUser is the embedded servers' system account user.
const benchSysUser = "shardctl-bench-system"

// OpenServer starts n embedded servers (1, or a cluster of n), unless url
// names a server to use, which Close leaves as it is.
func OpenServer(url string, n int) (*Server, error) {
	if url != "" {
		return &Server{url: url}, nil
	}
	dir, err := os.MkdirTemp("", "shardctl-bench-")
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir, sys: nuid.Next()}
	if err := s.start(n); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// Close shuts the embedded servers down and removes their stores.
func (s *Server) Close() {
	for _, srv := range s.srvs {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
}

// start starts n embedded servers with JetStream on random ports of
// 127.0.0.1, each storing in a directory of s.dir, a cluster of their own
// when n > 1, with a system account whose user benchSysUser has password
// s.sys (every other client is in the global account, without
// credentials), and waits until they accept connections and, as a
// cluster, have a JetStream meta leader.
func (s *Server) start(n int) error {
	var routes []*url.URL
	var clusterPorts []int
	if n > 1 {
		for range n {
			p, err := freePort()
			if err != nil {
				return err
			}
			clusterPorts = append(clusterPorts, p)
			routes = append(routes, &url.URL{Scheme: "nats-route", Host: "127.0.0.1:" + strconv.Itoa(p)})
		}
	}
	var urls []string
	for i := range n {
		acc := server.NewAccount("SYS")
		opts := &server.Options{
			ServerName: "shardctl-bench-" + strconv.Itoa(i+1), Host: "127.0.0.1", Port: -1,
			JetStream: true, StoreDir: filepath.Join(s.dir, strconv.Itoa(i+1)), NoLog: true, NoSigs: true, DisableJetStreamBanner: true,
			PingInterval: 2 * time.Second, MaxPingsOut: 3,
			Accounts: []*server.Account{acc}, SystemAccount: acc.Name, NoAuthUser: "bench",
			Users: []*server.User{{Username: benchSysUser, Password: s.sys, Account: acc}, {Username: "bench"}},
		}
		if n > 1 {
			opts.Cluster = server.ClusterOpts{Name: "shardctl-bench", Host: "127.0.0.1", Port: clusterPorts[i], PoolSize: -1}
			opts.Routes = routes
		}
		srv, err := server.NewServer(opts)
		if err != nil {
			return fmt.Errorf("embedded NATS server: %w", err)
		}
		srv.Start()
		s.srvs = append(s.srvs, srv)
		if !srv.ReadyForConnections(10 * time.Second) {
			return errors.New("embedded NATS server did not start")
		}
		urls = append(urls, srv.ClientURL())
	}
	s.url = strings.Join(urls, ",")
	if n == 1 {
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, srv := range s.srvs {
			if srv.JetStreamIsLeader() && len(srv.JetStreamClusterPeers()) == n {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the %d embedded NATS servers have no JetStream meta leader after 30 s", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// freePort is a port of 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
