package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

var binDir string

// TestMain builds the binaries the tests run: shardd and shardctl (with the
// race detector when the tests run with it), a shardd without it for the
// load test (which measures throughput), nats-server from its module for
// tests that need a NATS cluster of separate processes, and the library's
// example programs examples/shop and examples/jobs.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "natshard-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	race := []string{}
	if raceEnabled {
		race = []string{"-race"}
	}
	builds := []struct {
		out, pkg string
		flags    []string
	}{
		{"shardd", "github.com/natshard/natshard/cmd/shardd", race},
		{"shardctl", "github.com/natshard/natshard/cmd/shardctl", nil},
		{"shardd-fast", "github.com/natshard/natshard/cmd/shardd", nil},
		{"nats-server", "github.com/nats-io/nats-server/v2", nil},
		{"shop", "github.com/natshard/natshard/examples/shop", race},
		{"jobs", "github.com/natshard/natshard/examples/jobs/cmd/jobs", race},
	}
	for _, b := range builds {
		args := append(append([]string{"build"}, b.flags...), "-o", filepath.Join(dir, b.out), b.pkg)
		cmd := exec.Command("go", args...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building", b.out, ":", err)
			os.Exit(1)
		}
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proc is a running shardd.
type proc struct {
	t       *testing.T
	name    string
	cmd     *exec.Cmd
	log     *natstest.Buffer
	done    chan struct{}
	exitErr error
}

// startShardd starts shardd with args; its log is printed if the test fails.
func startShardd(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	return startProcess(t, "shardd", name, args...)
}

// startProcess starts one of the binaries TestMain built.
func startProcess(t *testing.T, bin, name string, args ...string) *proc {
	t.Helper()
	return startProcessOn(t, nil, bin, name, args...)
}

// startProcessOn starts one of the binaries TestMain built (or, given
// an absolute path, that program) on host h (in its network namespace),
// or on this machine when h is nil.
func startProcessOn(t *testing.T, h *netHost, bin, name string, args ...string) *proc {
	t.Helper()
	p := &proc{t: t, name: name, log: &natstest.Buffer{}, done: make(chan struct{})}
	path := bin
	if !filepath.IsAbs(bin) {
		path = filepath.Join(binDir, bin)
	}
	bin = filepath.Base(bin)
	p.cmd = exec.Command(path, args...)
	if h != nil {
		// ip netns exec execs the program: the pid is shardd's own.
		p.cmd = exec.Command("ip", append([]string{"netns", "exec", h.name, path}, args...)...)
	}
	p.cmd.Env = append(os.Environ(), "NATS_URL=", "NATSHARD_LOG_LEVEL=debug")
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s %s: %v", bin, name, err)
	}
	go func() {
		p.exitErr = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("---- log of %s %s ----\n%s", bin, name, lastLines(p.log.String(), 80))
		}
		if t.Failed() || os.Getenv("NATSHARD_KEEP_LOGS") != "" {
			if f := keepLog(t, bin+"-"+name, p.log.String()); f != "" {
				t.Logf("---- the whole log of %s %s: %s", bin, name, f)
			}
		}
	})
	return p
}

// keepLog writes a failed test's (with NATSHARD_KEEP_LOGS set, every
// test's) whole process log under
// $NATSHARD_TEST_LOGS (default: the system's temporary directory) and
// returns the file's name; "" if it could not.
func keepLog(t *testing.T, name, log string) string {
	dir := os.Getenv("NATSHARD_TEST_LOGS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "natshard-test-logs")
	}
	dir = filepath.Join(dir, strings.NewReplacer("/", "_", " ", "_").Replace(t.Name()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return ""
	}
	f := filepath.Join(dir, name+".log")
	if os.WriteFile(f, []byte(log), 0o644) != nil {
		return ""
	}
	return f
}

func lastLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// kill sends SIGKILL and waits for the process to end.
func (p *proc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM and waits for a graceful exit.
func (p *proc) stop(timeout time.Duration) error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.exitErr
	case <-time.After(timeout):
		return fmt.Errorf("shardd %s did not exit within %s", p.name, timeout)
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	return natstest.FreePorts(t, 1)[0]
}

func connect(t *testing.T, url string) *nats.Conn {
	t.Helper()
	var nc *nats.Conn
	natstest.Eventually(t, 20*time.Second, "connect to NATS", func() error {
		var err error
		nc, err = nats.Connect(url, nats.MaxReconnects(-1))
		return err
	})
	t.Cleanup(nc.Close)
	return nc
}

// status asks the coordinator for its status.
func status(nc *nats.Conn, subjects protocol.Subjects) (protocol.Status, error) {
	var st protocol.Status
	m, err := nc.Request(subjects.Admin(protocol.AdminStatus), nil, 2*time.Second)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(m.Data, &st)
}

// settled checks that every shard is active on one of the live regions and
// that the coordinator lists exactly those regions.
func settled(st protocol.Status, live ...string) error {
	if len(st.Table) != st.Shards {
		return fmt.Errorf("table has %d rows, want %d", len(st.Table), st.Shards)
	}
	isLive := map[string]bool{}
	for _, r := range live {
		isLive[r] = true
	}
	if len(st.Regions) != len(live) {
		return fmt.Errorf("coordinator lists %d regions, want %v", len(st.Regions), live)
	}
	for _, r := range st.Regions {
		if !isLive[r.ID] {
			return fmt.Errorf("coordinator lists region %s, want %v", r.ID, live)
		}
	}
	for _, s := range st.Table {
		if s.State != "active" || !isLive[s.Region] {
			return fmt.Errorf("shard %d is %s on %q", s.Shard, s.State, s.Region)
		}
	}
	return nil
}

// owners maps shard -> region.
func owners(st protocol.Status) map[int]string {
	m := make(map[int]string, len(st.Table))
	for _, s := range st.Table {
		m[s.Shard] = s.Region
	}
	return m
}

// kvRequest sends a kv entity request and decodes {"ok":..,"value":..}.
func kvRequest(ctx context.Context, nc *nats.Conn, subject, body string) (map[string]any, error) {
	m, err := nc.RequestWithContext(ctx, subject, []byte(body))
	if err != nil {
		return nil, err
	}
	var out map[string]any
	if err := json.Unmarshal(m.Data, &out); err != nil {
		return nil, fmt.Errorf("reply %q: %w", m.Data, err)
	}
	if e := m.Header.Get(protocol.HeaderError); e != "" {
		return out, fmt.Errorf("error header: %s", e)
	}
	return out, nil
}

// startNATSCluster starts three nats-server processes forming a cluster
// with JetStream, and returns their client URLs, comma-separated.
func startNATSCluster(t *testing.T) string {
	t.Helper()
	return startNATS(t, "127.0.0.1").urls("127.0.0.1")
}
