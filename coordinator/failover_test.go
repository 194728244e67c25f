package coordinator_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// Fast failover and crash detection (issue 17): a candidate deposes a
// lease holder whose connection is gone instead of waiting for the lease
// to expire; the coordinator learns of a region's closed connection from
// the server's disconnect advisory instead of waiting for its next probe.
// Leases and probe intervals are long here, so that nothing else can make
// these tests pass within their deadlines; the times are printed.

// runCandidate runs a coordinator candidate until the test ends.
func runCandidate(t *testing.T, cfg coordinator.Config) {
	t.Helper()
	t.Cleanup(runNode(cfg))
}

// candidateConfig is a candidate named name on its own connection nc.
func candidateConfig(t *testing.T, nc *nats.Conn, name string) coordinator.Config {
	_, store, buffer, subjects := openTypeOn(t, nc)
	return coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: name, LeaseTTL: 30 * time.Second}
}

// leaderIs waits until name leads and every shard is active on a live
// region, and returns the status.
func leaderIs(t *testing.T, nc *nats.Conn, subjects protocol.Subjects, name string, after uint64) protocol.Status {
	t.Helper()
	var st protocol.Status
	natstest.Eventually(t, 20*time.Second, name+" leads", func() error {
		var err error
		if st, err = status(nc, subjects); err != nil {
			return err
		}
		if st.Coordinator.Region != name || st.Coordinator.Epoch <= after {
			return fmt.Errorf("coordinator %s epoch %d", st.Coordinator.Region, st.Coordinator.Epoch)
		}
		for _, s := range st.Table {
			if s.State != "active" {
				return fmt.Errorf("shard %d is %s", s.Shard, s.State)
			}
		}
		return nil
	})
	return st
}

// sameTable fails unless every shard is active where it was: no shard with
// a live owner moved, no row was lost.
func sameTable(t *testing.T, before, after protocol.Status) {
	t.Helper()
	if len(after.Table) != len(before.Table) {
		t.Fatalf("table has %d rows, had %d", len(after.Table), len(before.Table))
	}
	for i, s := range before.Table {
		if a := after.Table[i]; a.Region != s.Region || a.State != "active" {
			t.Errorf("shard %d: %s on %s, was %s on %s", s.Shard, a.State, a.Region, s.State, s.Region)
		}
	}
}

// probed waits until the lease holder's probe subject got n probes (of
// another candidate: it has learnt who holds the lease), watching them on
// nc without answering. The watch ends before probed returns: its
// interest would hide the holder's "no responders".
func probed(t *testing.T, nc *nats.Conn, store *kvstate.Store, subjects protocol.Subjects, n int) {
	t.Helper()
	holder, _, err := store.Coordinator(context.Background())
	if err != nil || holder.Probe == "" {
		t.Fatalf("the lease %+v (%v) names no probe subject", holder, err)
	}
	sub, err := nc.SubscribeSync(subjects.Coordinator(holder.Probe))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe(); _ = nc.Flush() }()
	for i := range n {
		if _, err := sub.NextMsg(20 * time.Second); err != nil {
			t.Fatalf("probe %d of %d of the holder: %v", i+1, n, err)
		}
	}
}

// TestDeposeHolderWhoseConnectionClosed: the holder's connection closes
// (as when its process is killed). The other candidate finds no responders
// on the holder's probe subject for HolderSilence, deposes it and leads,
// long before the 30 s lease could expire; the table is as it was. With
// the server's disconnect advisories the candidate probes at once; without
// them, at its next probe.
func TestDeposeHolderWhoseConnectionClosed(t *testing.T) {
	for _, advisories := range []bool{false, true} {
		t.Run(fmt.Sprintf("advisories=%v", advisories), func(t *testing.T) {
			srv := natstest.RunServerWithOptions(t, natstest.WithSystemAccount(natstest.DefaultOptions(t)))
			url := natstest.URL(srv)
			nc, store, buffer, subjects := openTypeOn(t, natstest.Connect(t, url))
			openRegion(t, nc, store, buffer, subjects, "r1", entities.Echo())
			conns := map[string]*nats.Conn{}
			start := func(name string) {
				conns[name] = natstest.Connect(t, url)
				cfg := candidateConfig(t, conns[name], name)
				if advisories {
					// Only an advisory makes the candidate probe again,
					// and deposes the holder at once: nobody reconnects
					// behind a connection its client closed.
					cfg.HolderProbe, cfg.HolderSilence = time.Hour, time.Hour
					cfg.Disconnects = coordinator.DisconnectAdvisories(natstest.Connect(t, url, nats.UserInfo(natstest.SystemUser, natstest.SystemPassword)))
				}
				runCandidate(t, cfg)
			}
			start("c1")
			before := leaderIs(t, nc, subjects, "c1", 0)
			start("c2")
			probed(t, nc, store, subjects, 1) // c2 knows c1 holds the lease, and waits

			took := tookLeaseAfter(t, nc, subjects, "c2")
			t0 := time.Now()
			conns["c1"].Close()
			after := leaderIs(t, nc, subjects, "c2", before.Coordinator.Epoch)
			t.Logf("holder's connection closed: c2 leads (epoch %d -> %d) after %s; lease TTL 30s",
				before.Coordinator.Epoch, after.Coordinator.Epoch, took(t0))
			sameTable(t, before, after)
		})
	}
}

// TestHolderReconnectingKeepsLease: the holder's connection drops and comes
// back (a proxy cuts it: the server drops its subscriptions at once). A
// silence shorter than HolderSilence, though the other candidate probes
// every 50 ms through it, deposes no one; a longer one does, and the old
// holder, back, steps down: one coordinator answers, and the table is as
// it was.
func TestHolderReconnectingKeepsLease(t *testing.T) {
	srv := natstest.RunServer(t)
	proxy := natstest.NewProxy(t, srv.Addr().String())
	nc, store, buffer, subjects := openTypeOn(t, natstest.Connect(t, natstest.URL(srv)))
	openRegion(t, nc, store, buffer, subjects, "r1", entities.Echo())

	nc1 := natstest.Connect(t, proxy.URL(), nats.ReconnectWait(20*time.Millisecond), nats.MaxReconnects(-1))
	runCandidate(t, candidateConfig(t, nc1, "c1"))
	before := leaderIs(t, nc, subjects, "c1", 0)
	cfg := candidateConfig(t, natstest.Connect(t, natstest.URL(srv)), "c2")
	cfg.HolderProbe, cfg.HolderSilence = 50*time.Millisecond, 1500*time.Millisecond
	runCandidate(t, cfg)
	probed(t, nc, store, subjects, 1) // c2 is probing c1

	reconnected := func(n uint64) func() error {
		return func() error {
			if got := nc1.Stats().Reconnects; got < n || !nc1.IsConnected() {
				return fmt.Errorf("c1 reconnected %d times, connected %v", got, nc1.IsConnected())
			}
			return nil
		}
	}
	proxy.Cut(400 * time.Millisecond)
	t0 := time.Now()
	natstest.Eventually(t, 20*time.Second, "c1 reconnected", reconnected(1))
	t.Logf("c1's connection cut for 400 ms: back after %s", time.Since(t0).Round(time.Millisecond))
	// c2 probes on, answered, for two silences' worth of probes: had the
	// short cut deposed c1, it would have by then.
	probed(t, nc, store, subjects, int(2*cfg.HolderSilence/cfg.HolderProbe))
	if st, err := status(nc, subjects); err != nil || st.Coordinator.Region != "c1" || st.Coordinator.Epoch != before.Coordinator.Epoch {
		t.Fatalf("after a short cut: coordinator %+v (%v), want c1 still at epoch %d", st.Coordinator, err, before.Coordinator.Epoch)
	}

	took := tookLeaseAfter(t, nc, subjects, "c2")
	proxy.Cut(4 * time.Second)
	t0 = time.Now()
	after := leaderIs(t, nc, subjects, "c2", before.Coordinator.Epoch)
	t.Logf("c1's connection cut for 4 s: c2 leads after %s (silence %s)", took(t0), cfg.HolderSilence)
	natstest.Eventually(t, 20*time.Second, "c1 reconnected", reconnected(2))
	natstest.Eventually(t, 20*time.Second, "one coordinator answers", func() error {
		if n := coordinators(t, nc, subjects); n != 1 {
			return fmt.Errorf("%d coordinators answer", n)
		}
		return nil
	})
	st, err := status(nc, subjects)
	if err != nil || st.Coordinator.Region != "c2" {
		t.Fatalf("coordinator %+v (%v), want c2", st.Coordinator, err)
	}
	sameTable(t, before, after)
	sameTable(t, before, st)
}

// tookLeaseAfter watches the events subject and returns a function that
// says how long after t0 name announced that it leads (the status
// requests that find out may wait for a timeout: one sent as the old
// holder's connection closes is lost with it).
func tookLeaseAfter(t *testing.T, nc *nats.Conn, subjects protocol.Subjects, name string) func(t0 time.Time) time.Duration {
	t.Helper()
	sub, err := nc.SubscribeSync(subjects.Events())
	if err != nil {
		t.Fatal(err)
	}
	return func(t0 time.Time) time.Duration {
		t.Helper()
		for {
			m, err := sub.NextMsg(5 * time.Second)
			if err != nil {
				t.Fatalf("no event of %s leading: %v", name, err)
			}
			var ev protocol.Event
			if json.Unmarshal(m.Data, &ev) == nil && ev.Kind == protocol.EventCoordinator && ev.Region == name {
				at, err := time.Parse(time.RFC3339Nano, ev.Time)
				if err != nil {
					t.Fatal(err)
				}
				return at.Sub(t0).Round(time.Millisecond)
			}
		}
	}
}

// coordinators counts the answers to one status request.
func coordinators(t *testing.T, nc *nats.Conn, subjects protocol.Subjects) int {
	t.Helper()
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.PublishRequest(subjects.Admin(protocol.AdminStatus), inbox, nil); err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		if _, err := sub.NextMsg(500 * time.Millisecond); err != nil {
			return n
		}
		n++
	}
}

// TestRegionCrashFoundByAdvisory: a region's connection closes (as when
// its process is killed). With probes an hour apart and a 60 s
// registration, only the server's disconnect advisory can tell the
// coordinator: it probes the region at once, finds no responders and
// re-homes its shards; the other region's shards stay.
func TestRegionCrashFoundByAdvisory(t *testing.T) {
	srv := natstest.RunServerWithOptions(t, natstest.WithSystemAccount(natstest.DefaultOptions(t)))
	url := natstest.URL(srv)
	nc, store, buffer, subjects := openTypeOn(t, natstest.Connect(t, url))
	open := func(id string) *nats.Conn {
		rc := natstest.Connect(t, url)
		_, store, buffer, _ := openTypeOn(t, rc)
		agent, err := region.Open(context.Background(), region.Config{Conn: rc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, ID: id,
			Factory: entities.Echo(), LeaseTTL: 60 * time.Second, ReleaseGrace: -1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { agent.Close(context.Background()) })
		return rc
	}
	open("a")
	rb := open("b")
	runCandidate(t, coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "c",
		MinRegions: 2, ProbeInterval: time.Hour, RebalanceInterval: -1, ReleaseGrace: -1,
		Disconnects: coordinator.DisconnectAdvisories(natstest.Connect(t, url, nats.UserInfo(natstest.SystemUser, natstest.SystemPassword)))})
	before := leaderIs(t, nc, subjects, "c", 0)
	var ofB []int
	for _, s := range before.Table {
		if s.Region == "b" {
			ofB = append(ofB, s.Shard)
		}
	}
	if len(ofB) == 0 || len(ofB) == shards {
		t.Fatalf("b holds %d of %d shards", len(ofB), shards)
	}

	t0 := time.Now()
	rb.Close()
	var after protocol.Status
	natstest.Eventually(t, 20*time.Second, "b's shards re-homed on a", func() error {
		var err error
		if after, err = status(nc, subjects); err != nil {
			return err
		}
		for _, s := range after.Table {
			if s.State != "active" || s.Region != "a" {
				return fmt.Errorf("shard %d %s on %s", s.Shard, s.State, s.Region)
			}
		}
		return nil
	})
	t.Logf("region b's connection closed: its %d shards re-homed on a after %s (probe interval 1h, registration TTL 60s)",
		len(ofB), time.Since(t0).Round(time.Millisecond))
	for _, s := range before.Table {
		if s.Region == "a" && !slices.ContainsFunc(after.Table, func(v protocol.ShardView) bool { return v.Shard == s.Shard && v.Region == "a" }) {
			t.Errorf("shard %d of the live region moved", s.Shard)
		}
	}
}

// resetDialer dials TCP and keeps the connection, so that a test can
// reset it (SO_LINGER 0: the kernel sends RST, as it does for a process
// killed with data it has not read).
type resetDialer struct{ conn *net.TCPConn }

func (d *resetDialer) Dial(network, address string) (net.Conn, error) {
	c, err := net.Dial(network, address)
	if err != nil {
		return nil, err
	}
	d.conn = c.(*net.TCPConn)
	return c, nil
}

// TestDisconnectAdvisoryReasons reads a real server's advisories for
// connections ended three ways: closed by the client, reset by the
// client's kernel (a process killed under load), and closed by the server
// (here kicked; a stale connection alike). The first two mean no process
// is reconnecting behind the connection (Disconnect.ByClient), so the
// coordinator removes the region without waiting for the silence.
func TestDisconnectAdvisoryReasons(t *testing.T) {
	srv := natstest.RunServerWithOptions(t, natstest.WithSystemAccount(natstest.DefaultOptions(t)))
	url := natstest.URL(srv)
	sys := natstest.Connect(t, url, nats.UserInfo(natstest.SystemUser, natstest.SystemPassword))
	got := make(chan coordinator.Disconnect, 16)
	unsubscribe, err := coordinator.DisconnectAdvisories(sys).Subscribe(func(d coordinator.Disconnect) { got <- d })
	if err != nil {
		t.Fatal(err)
	}
	defer unsubscribe()

	for _, tc := range []struct {
		name     string
		end      func(nc *nats.Conn, d *resetDialer) error
		byClient bool
	}{
		{"closed by the client", func(nc *nats.Conn, _ *resetDialer) error { nc.Close(); return nil }, true},
		{"reset by the client's kernel", func(_ *nats.Conn, d *resetDialer) error {
			if err := d.conn.SetLinger(0); err != nil {
				return err
			}
			return d.conn.Close()
		}, true},
		{"closed by the server", func(nc *nats.Conn, _ *resetDialer) error {
			return srv.DisconnectClientByID(protocol.ConnIDOf(nc).Client)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &resetDialer{}
			nc, err := nats.Connect(url, nats.SetCustomDialer(d), nats.NoReconnect())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			id := protocol.ConnIDOf(nc)
			if err := tc.end(nc, d); err != nil {
				t.Fatal(err)
			}
			deadline := time.After(10 * time.Second)
			for {
				select {
				case ev := <-got:
					if ev.Conn != id {
						continue // another test's connection
					}
					if ev.ByClient != tc.byClient {
						t.Fatalf("advisory for %v: ByClient %v, want %v", id, ev.ByClient, tc.byClient)
					}
					return
				case <-deadline:
					t.Fatalf("no advisory for %v", id)
				}
			}
		})
	}
}
