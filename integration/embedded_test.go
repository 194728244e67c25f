package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// embeddedCluster is three shardd whose embedded NATS servers form one
// cluster (--cluster, --routes): nothing else runs. A member can be killed
// and started again on its ports and data directory.
type embeddedCluster struct {
	t *testing.T
	memberPorts
	procs    [3]*proc
	starts   int
	shards   int
	subjects protocol.Subjects
	extra    []string // more flags for every member
	// extraOf, when set, gives member i's own flags after them (a flag
	// given again wins: --type, --kind).
	extraOf func(i int) []string
}

func newEmbeddedCluster(t *testing.T, shards int) *embeddedCluster {
	return &embeddedCluster{t: t, shards: shards, subjects: protocol.MustSubjects("", "", "kv"), memberPorts: newMemberPorts(t)}
}

func (c *embeddedCluster) name(i int) string { return fmt.Sprintf("s%d", i+1) }

// start starts member i (again, on its data directory).
func (c *embeddedCluster) start(i int) {
	c.t.Helper()
	var routes []string
	for j := range 3 {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", c.route[j]))
	}
	c.starts++
	args := []string{"--region", c.name(i), "--type", "kv", "--kind", "kv", "--shards", fmt.Sprint(c.shards), "--min-regions", "3",
		"--listen", fmt.Sprintf("127.0.0.1:%d", c.client[i]), "--data-dir", c.dirs[i],
		"--cluster", fmt.Sprintf("127.0.0.1:%d", c.route[i]), "--routes", strings.Join(routes, ","), "--cluster_name", "embedded-test",
		"--http", fmt.Sprintf("127.0.0.1:%d", c.http[i]), "--start-timeout", "10m"}
	args = append(args, c.extra...)
	if c.extraOf != nil {
		args = append(args, c.extraOf(i)...)
	}
	c.procs[i] = startShardd(c.t, fmt.Sprintf("%s-%d", c.name(i), c.starts), args...)
}

// url is member i's client URL.
func (c *embeddedCluster) url(i int) string { return fmt.Sprintf("nats://127.0.0.1:%d", c.client[i]) }

// urls is every member's client URL, comma-separated.
func (c *embeddedCluster) urls() string {
	return strings.Join([]string{c.url(0), c.url(1), c.url(2)}, ",")
}

// ready says why member i's /readyz is not 200 (its JetStream current
// with the cluster, its region registered), or nil.
func (c *embeddedCluster) ready(i int) error {
	select {
	case <-c.procs[i].done:
		c.t.Fatalf("shardd %s exited: %v", c.procs[i].name, c.procs[i].exitErr)
	default:
	}
	code, body := httpGet(c.t, fmt.Sprintf("http://127.0.0.1:%d/readyz", c.http[i]))
	if code != http.StatusOK {
		return fmt.Errorf("/readyz of %s: %d %s", c.name(i), code, strings.TrimSpace(body))
	}
	return nil
}

// served waits until every shard is active on the live regions and
// answers exactly once.
func (c *embeddedCluster) served(nc *nats.Conn, timeout time.Duration, live ...string) {
	c.t.Helper()
	natstest.Eventually(c.t, timeout, fmt.Sprintf("every shard served once on %v", live), func() error {
		st, err := status(nc, c.subjects)
		if err != nil {
			return err
		}
		if err := settled(st, live...); err != nil {
			return err
		}
		return singleOwner(nc, c.subjects, c.shards)
	})
}

// TestEmbeddedClusterKills (issue 32): three shardd whose embedded servers
// form the NATS cluster, nothing else, started at once in reverse order,
// all come up without a restart. Under load (kv increments with
// Nats-Msg-Id, from a client that knows only the first member's URL and
// learns the others from the cluster), each member in turn, the first
// included, is killed with -9, every shard is served again by the other
// two, then it is started again on its data directory and waited for
// (/readyz: JetStream current) before the next: every acknowledged
// increment is kept. Last, a SIGTERM of one member leaves the other two
// serving every shard.
func TestEmbeddedClusterKills(t *testing.T) {
	c := newEmbeddedCluster(t, 32)
	for _, i := range []int{2, 1, 0} {
		c.start(i)
	}
	t0 := time.Now()
	nc := connect(t, c.urls())
	all := []string{"s1", "s2", "s3"}
	c.served(nc, 4*time.Minute, all...)
	natstest.Eventually(t, 2*time.Minute, "every member ready", func() error {
		for i := range 3 {
			if err := c.ready(i); err != nil {
				return err
			}
		}
		return nil
	})
	t.Logf("embedded cluster: three shardd started at once came up, every shard served, in %s", time.Since(t0).Round(time.Millisecond))
	for i := range 3 {
		if !strings.Contains(c.procs[i].log.String(), "embedded NATS server is a cluster member") {
			t.Fatalf("shardd %s did not say its embedded server is a cluster member", c.name(i))
		}
	}

	load := startIncrLoad(t, c.url(0), c.subjects, c.shards, 100, 4)
	for i := range 3 {
		time.Sleep(3 * time.Second) // load before the kill
		var live []string
		for j := range 3 {
			if j != i {
				live = append(live, c.name(j))
			}
		}
		kill := time.Now()
		c.procs[i].kill()
		c.served(nc, 3*time.Minute, live...)
		servedAfter := time.Since(kill)
		restart := time.Now()
		c.start(i)
		c.served(nc, 3*time.Minute, all...)
		natstest.Eventually(t, 3*time.Minute, c.name(i)+" ready again (JetStream current)", func() error { return c.ready(i) })
		t.Logf("embedded cluster: kill -9 of %s: every shard served again by %v after %s; restarted on its data directory, back with JetStream current after %s (acknowledged so far %d)",
			c.name(i), live, servedAfter.Round(time.Millisecond), time.Since(restart).Round(time.Millisecond), acked(load))
	}

	// A graceful stop of one member: its shards are handed off, its
	// server leaves the cluster, the other two go on.
	time.Sleep(3 * time.Second)
	stop := time.Now()
	if err := c.procs[1].stop(2 * time.Minute); err != nil {
		t.Fatalf("SIGTERM of s2: %v", err)
	}
	stopped := time.Since(stop)
	c.served(nc, 3*time.Minute, "s1", "s3")
	for _, i := range []int{0, 2} {
		natstest.Eventually(t, time.Minute, c.name(i)+" ready", func() error { return c.ready(i) })
	}
	t.Logf("embedded cluster: SIGTERM of s2: exited in %s, every shard served by s1 and s3 %s after the signal",
		stopped.Round(time.Millisecond), time.Since(stop).Round(time.Millisecond))
	time.Sleep(2 * time.Second)
	load.halt()
	load.check(t, false)
	// Each member kept its server name across its restart.
	for i := range 3 {
		name, err := os.ReadFile(filepath.Join(c.dirs[i], "natshard-server-name"))
		if want := "natshard-" + c.name(i) + "\n"; err != nil || string(name) != want {
			t.Errorf("server name of %s: %q, %v; want %q", c.name(i), name, err, want)
		}
	}
}

// acked is the load's acknowledged increments so far.
func acked(l *incrLoad) int64 {
	var n int64
	for i := range l.acked {
		n += l.acked[i].Load()
	}
	return n
}

// TestEmbeddedClusterDurable (issue 32): a type of durable delivery on
// three shardd whose embedded servers are the NATS cluster, under an
// append load published through the type's stream by a client given only
// the first member's URL; the first member is killed with -9 (its server,
// a replica of the stream, with it) and started again on its data
// directory: every value the stream acknowledged is applied, none twice,
// in order.
func TestEmbeddedClusterDurable(t *testing.T) {
	c := newEmbeddedCluster(t, 32)
	c.extra = []string{"--delivery", "durable"}
	for i := range 3 {
		c.start(i)
	}
	nc := connect(t, c.urls())
	all := []string{"s1", "s2", "s3"}
	c.served(nc, 4*time.Minute, all...)
	load := startAppendLoad(t, c.url(0), c.subjects, c.shards, 200, 1000, false)
	time.Sleep(3 * time.Second)
	kill := time.Now()
	c.procs[0].kill()
	c.served(nc, 3*time.Minute, "s2", "s3")
	servedAfter := time.Since(kill)
	c.start(0)
	c.served(nc, 3*time.Minute, all...)
	natstest.Eventually(t, 3*time.Minute, "s1 ready again (JetStream current)", func() error { return c.ready(0) })
	t.Logf("embedded cluster: durable kill -9 of s1: every shard served again by s2 and s3 after %s; s1 back, current, %s after the kill",
		servedAfter.Round(time.Millisecond), time.Since(kill).Round(time.Millisecond))
	time.Sleep(3 * time.Second)
	load.halt()
	load.check(t)
}

// TestEmbeddedClusterAppDown (issue 32): three shardd --kind http, each
// with its app, whose embedded servers are the NATS cluster. The first
// one's app dies: that shardd leaves (its shards handed off) and exits 1,
// its server with it (docs/OPERATIONS.md, the lifecycle rule), and the
// other two serve every shard; requests sent meanwhile by a client given
// only the first member's URL are all answered. Before, the first
// process's embedded server was the only NATS server, and its app's outage
// stopped the whole type.
func TestEmbeddedClusterAppDown(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skipf("python3 is not installed (%v): the sidecar's Python app cannot run", err)
	}
	script, err := filepath.Abs("testdata/sidecar_app.py")
	if err != nil {
		t.Fatal(err)
	}
	c := newEmbeddedCluster(t, 16)
	c.subjects = protocol.MustSubjects("", "", "counter")
	appPorts := natstest.FreePorts(t, 3)
	var apps [3]*proc
	c.extraOf = func(i int) []string {
		return []string{"--type", "counter", "--kind", "http", "--app", fmt.Sprintf("http://127.0.0.1:%d", appPorts[i]), "--app-down-after", "3s"}
	}
	for i := range 3 {
		apps[i] = startProcess(t, python, "app-"+c.name(i), script, strconv.Itoa(appPorts[i]))
		c.start(i)
	}
	nc := connect(t, c.urls())
	c.served(nc, 4*time.Minute, "s1", "s2", "s3")

	client := natshard.NewClient(connect(t, c.url(0)), natshard.WithResend(2*time.Second))
	// Until s1 notices that its app is down (--app-down-after), the
	// requests to its shards fail with the app's error ("app: ... connection
	// refused"): the sidecar's behaviour, not the cluster's. Such a request
	// is sent again (its number again: the app answers a repeat without
	// applying it); any other failure, and any failure once s2 and s3
	// serve every shard, fails the test.
	type failure struct {
		at  time.Time
		err string
	}
	var (
		answered atomic.Int64
		mu       sync.Mutex
		failures []failure
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	for e := range 12 {
		id := fmt.Sprintf("counter-%d", e)
		wg.Go(func() {
			for seq := 1; ; {
				select {
				case <-stop:
					return
				default:
				}
				sent := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				data, err := client.Request(ctx, "counter", id, fmt.Appendf(nil, `{"seq":%d}`, seq))
				cancel()
				var got struct{ Last int }
				if err == nil && (json.Unmarshal(data, &got) != nil || got.Last != seq) {
					err = fmt.Errorf("answered %q", data)
				}
				if err != nil {
					mu.Lock()
					// When it was sent: an app's timeout (5 s) answers a
					// request sent before s2 and s3 served every shard
					// well after they did.
					failures = append(failures, failure{sent, fmt.Sprintf("%s %d: %v", id, seq, err)})
					mu.Unlock()
					time.Sleep(200 * time.Millisecond)
					continue
				}
				answered.Add(1)
				seq++
			}
		})
	}
	time.Sleep(3 * time.Second)
	down := time.Now()
	apps[0].kill()
	select {
	case <-c.procs[0].done:
	case <-time.After(2 * time.Minute):
		t.Fatal("shardd s1 did not exit within 2 minutes of its app's death")
	}
	exited := time.Since(down)
	if c.procs[0].exitErr == nil {
		t.Errorf("shardd s1 exited 0 after its app died; want 1")
	}
	c.served(nc, 3*time.Minute, "s2", "s3")
	servedAfter := time.Since(down)
	for _, i := range []int{1, 2} {
		natstest.Eventually(t, time.Minute, c.name(i)+" ready", func() error { return c.ready(i) })
	}
	before := answered.Load()
	time.Sleep(3 * time.Second)
	close(stop)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	appDown := 0
	for _, f := range failures {
		if strings.Contains(f.err, ": app: ") && f.at.Before(down.Add(servedAfter)) {
			appDown++
			continue
		}
		t.Errorf("a request sent %s after the app died failed: %s", f.at.Sub(down).Round(time.Millisecond), f.err)
	}
	if answered.Load() == before {
		t.Error("no request answered in the 3 s after s2 and s3 took every shard")
	}
	t.Logf("embedded cluster: app of s1 down: s1 left and exited after %s, every shard served by s2 and s3 %s after the app died; %d requests answered, %d refused by s1 with its app's error before it left (sent again)",
		exited.Round(time.Millisecond), servedAfter.Round(time.Millisecond), answered.Load(), appDown)
}
