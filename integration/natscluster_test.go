package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// natsCluster is three nats-server processes forming a cluster with
// JetStream, each with its own store; a server can be killed and started
// again on the same ports and store.
type natsCluster struct {
	t      *testing.T
	listen string // client listen address
	memberPorts
	procs  [3]*proc
	starts int
	// routeVia, when set, is the port server from dials to reach server
	// to's routes (a proxy's): the campaign cuts routes there.
	routeVia func(from, to int) int
	// extra arguments of every server.
	extra []string
}

// startNATS starts the cluster, clients listening on listen (127.0.0.1, or
// 0.0.0.0 when other hosts must reach it), and returns once JetStream
// answers.
func startNATS(t *testing.T, listen string) *natsCluster {
	t.Helper()
	return startNATSWith(t, listen, nil)
}

// startNATSWith is startNATS, with setup called on the cluster once its
// ports are chosen, before any server starts (to set routeVia and extra).
func startNATSWith(t *testing.T, listen string, setup func(*natsCluster)) *natsCluster {
	t.Helper()
	c := newNATS(t, listen)
	if setup != nil {
		setup(c)
	}
	for i := range 3 {
		c.start(i)
	}
	nc := connect(t, c.urls("127.0.0.1"))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 60*time.Second, "JetStream on the NATS cluster", func() error {
		for i := range 3 {
			select {
			case <-c.procs[i].done:
				t.Fatalf("nats-server %s exited while the cluster started (its log is above)", c.name(i))
			default:
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(ctx)
		return err
	})
	return c
}

// newNATS is a cluster of three nats-server processes (as startNATS's),
// none started yet: start them with start.
func newNATS(t *testing.T, listen string) *natsCluster {
	t.Helper()
	return &natsCluster{t: t, listen: listen, memberPorts: newMemberPorts(t)}
}

// memberPorts are the ports and store directories of a three-member NATS
// cluster (nats-server processes, or shardd's embedded servers).
type memberPorts struct {
	client, route, http [3]int
	dirs                [3]string
}

func newMemberPorts(t *testing.T) memberPorts {
	var m memberPorts
	ports := natstest.FreePorts(t, 9)
	for i := range 3 {
		m.client[i], m.route[i], m.http[i] = ports[3*i], ports[3*i+1], ports[3*i+2]
		m.dirs[i] = t.TempDir()
	}
	return m
}

func (c *natsCluster) name(i int) string { return fmt.Sprintf("n%d", i+1) }

// start starts server i (again).
func (c *natsCluster) start(i int) {
	c.t.Helper()
	var routes []string
	for j := range 3 {
		port := c.route[j]
		if c.routeVia != nil {
			if j == i {
				continue
			}
			port = c.routeVia(i, j)
		}
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", port))
	}
	c.starts++
	args := []string{"-a", c.listen, "-p", fmt.Sprint(c.client[i]), "-m", fmt.Sprint(c.http[i]), "-n", c.name(i),
		"-js", "-sd", c.dirs[i],
		"--cluster_name", "natshard-test", "--cluster", fmt.Sprintf("nats://127.0.0.1:%d", c.route[i]), "--routes", strings.Join(routes, ",")}
	c.procs[i] = startProcess(c.t, "nats-server", fmt.Sprintf("%s-%d", c.name(i), c.starts), append(args, c.extra...)...)
}

// urls is the client URLs of the three servers at addr, comma-separated.
func (c *natsCluster) urls(addr string) string {
	var urls []string
	for i := range 3 {
		urls = append(urls, fmt.Sprintf("nats://%s:%d", addr, c.client[i]))
	}
	return strings.Join(urls, ",")
}

// monitor GETs path of server i's monitoring endpoint into v.
func (c *natsCluster) monitor(i int, path string, v any) error {
	client := http.Client{Timeout: 2 * time.Second}
	resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:%d%s", c.http[i], path))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s of %s: %s: %s", path, c.name(i), resp.Status, body)
	}
	return json.Unmarshal(body, v)
}

// serverOf returns the server the client connection named name is on.
func (c *natsCluster) serverOf(name string) (int, error) {
	for i := range 3 {
		select {
		case <-c.procs[i].done:
			continue
		default:
		}
		var connz struct {
			Connections []struct {
				Name string `json:"name"`
			} `json:"connections"`
		}
		if err := c.monitor(i, "/connz?limit=10000", &connz); err != nil {
			return 0, err
		}
		for _, conn := range connz.Connections {
			if conn.Name == name {
				return i, nil
			}
		}
	}
	return 0, fmt.Errorf("no server has a connection named %q", name)
}

// waitHealthy waits until every server says it is healthy: running, and
// JetStream current with the others.
func (c *natsCluster) waitHealthy(timeout time.Duration) {
	c.t.Helper()
	natstest.Eventually(c.t, timeout, "every NATS server healthy", func() error {
		for i := range 3 {
			var h struct {
				Status string `json:"status"`
				Error  string `json:"error"`
			}
			if err := c.monitor(i, "/healthz", &h); err != nil {
				return err
			}
			if h.Status != "ok" {
				return fmt.Errorf("%s: %s %s", c.name(i), h.Status, h.Error)
			}
		}
		return nil
	})
}

// netHost is a separate host for the processes started on it: a network
// namespace joined to this machine by a veth pair, whose network a test
// cuts and heals without touching the processes (a partition, not a crash).
type netHost struct {
	t       *testing.T
	name    string // of the namespace
	link    string // this machine's end of the veth pair
	gateway string // this machine's address as the host sees it
}

var netHosts atomic.Int32

// newNetHost makes a host, or skips the test where network namespaces
// cannot be made (they need root and iproute2).
func newNetHost(t *testing.T) *netHost {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipped: a network partition needs a network namespace, which needs root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("skipped: a network partition needs a network namespace, and `ip` (iproute2) is not installed")
	}
	n := int(netHosts.Add(1))
	id := fmt.Sprintf("%d-%d", os.Getpid()%100000, n)
	h := &netHost{t: t, name: "natshard-" + id, link: "ns" + id + "h"}
	// A /30 per host, in 10.213.0.0/16, chosen by pid and count so that
	// concurrent test processes do not collide.
	net := (os.Getpid()%64)*4 + n%4
	h.gateway = fmt.Sprintf("10.213.%d.1", net)
	peer := "ns" + id + "n"
	steps := [][]string{
		{"netns", "add", h.name},
		{"link", "add", h.link, "type", "veth", "peer", "name", peer},
		{"link", "set", peer, "netns", h.name},
		{"addr", "add", h.gateway + "/30", "dev", h.link},
		{"link", "set", h.link, "up"},
		{"netns", "exec", h.name, "ip", "addr", "add", fmt.Sprintf("10.213.%d.2/30", net), "dev", peer},
		{"netns", "exec", h.name, "ip", "link", "set", peer, "up"},
		{"netns", "exec", h.name, "ip", "link", "set", "lo", "up"},
		{"netns", "exec", h.name, "ip", "route", "add", "default", "via", h.gateway},
	}
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", h.name).Run()
		_ = exec.Command("ip", "link", "del", h.link).Run()
	})
	for i, args := range steps {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			if i == 0 {
				t.Skipf("skipped: cannot make a network namespace here: ip %s: %v: %s", strings.Join(args, " "), err, out)
			}
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	return h
}

// cut takes the host off the network: packets are dropped both ways, open
// TCP connections stay open and stall, as when a cable is pulled.
func (h *netHost) cut() { h.ip("link", "set", h.link, "down") }

// heal puts the host back on the network.
func (h *netHost) heal() { h.ip("link", "set", h.link, "up") }

func (h *netHost) ip(args ...string) {
	h.t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		h.t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// events records the coordinator's events with the time they arrived.
type events struct {
	mu  sync.Mutex
	got []event
}

type event struct {
	at time.Time
	protocol.Event
}

func watchEvents(t *testing.T, nc *nats.Conn, subjects protocol.Subjects) *events {
	t.Helper()
	e := &events{}
	sub, err := nc.Subscribe(subjects.Events(), func(m *nats.Msg) {
		var ev protocol.Event
		if json.Unmarshal(m.Data, &ev) != nil {
			return
		}
		e.mu.Lock()
		e.got = append(e.got, event{at: time.Now(), Event: ev})
		e.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return e
}

// first returns the first event since t0 that match accepts.
func (e *events) first(t0 time.Time, match func(protocol.Event) bool) (event, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, ev := range e.got {
		if !ev.at.Before(t0) && match(ev.Event) {
			return ev, true
		}
	}
	return event{}, false
}

// parkedOf matches a shard of region parked (its owner gone).
func parkedOf(region string, before map[int]string) func(protocol.Event) bool {
	return func(ev protocol.Event) bool {
		return ev.Kind == protocol.EventShard && ev.State == string(protocol.StateParked) && ev.Shard != nil && before[*ev.Shard] == region
	}
}

// activeOf matches a shard of region (before) made active elsewhere.
func activeOf(region string, before map[int]string) func(protocol.Event) bool {
	return func(ev protocol.Event) bool {
		return ev.Kind == protocol.EventShard && ev.State == string(protocol.StateActive) && ev.Shard != nil && before[*ev.Shard] == region && ev.Region != region
	}
}

// lastSince formats the time from t0 to the last matching event, or "not
// seen".
func (e *events) lastSince(t0 time.Time, match func(protocol.Event) bool) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var last time.Time
	for _, ev := range e.got {
		if !ev.at.Before(t0) && match(ev.Event) {
			last = ev.at
		}
	}
	if last.IsZero() {
		return "not seen"
	}
	return last.Sub(t0).Round(time.Millisecond).String()
}

// since formats the time from t0 to the first matching event, or "not seen".
func (e *events) since(t0 time.Time, match func(protocol.Event) bool) string {
	if ev, ok := e.first(t0, match); ok {
		return ev.at.Sub(t0).Round(time.Millisecond).String()
	}
	return "not seen"
}
