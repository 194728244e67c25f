package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// appReport is what testdata/sidecar_app.py reports on GET /violations.
type appReport struct {
	Violations  []string `json:"violations"`
	Calls       int      `json:"calls"`
	Activations int      `json:"activations"`
	Stops       int      `json:"stops"`
	Applied     int      `json:"applied"`
	Repeated    int      `json:"repeated"`
	Peak        int      `json:"peak"`
}

// TestSidecar runs three shardd --kind http, each with its Python app
// (testdata/sidecar_app.py), and sends numbered requests to 24 entities,
// one at a time per entity, with natshard's Client (which resends a
// request that got no answer: those lost with a killed process), through
// three shardctl moves, a graceful stop and a kill -9 of a shardd (issue
// 15). It proves: every request is answered; every app saw each entity's
// calls one at a time, in order (activate, messages, stop; numbers
// consecutive, a number again only after a resend); every shard had one
// owner throughout; and each entity's state, read through the surviving
// shardd's state API, holds its last acknowledged number.
func TestSidecar(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skipf("python3 is not installed (%v): the sidecar's Python app cannot run", err)
	}
	script, err := filepath.Abs("testdata/sidecar_app.py")
	if err != nil {
		t.Fatal(err)
	}
	url := natstest.URL(natstest.RunServer(t))
	nc := connect(t, url)
	subjects := protocol.MustSubjects("", "", "counter")
	ports := natstest.FreePorts(t, 4)
	stateA := fmt.Sprintf("127.0.0.1:%d", ports[3])
	apps := map[string]string{}
	procs := map[string]*proc{}
	for i, name := range []string{"a", "b", "c"} {
		startProcess(t, python, "app-"+name, script, strconv.Itoa(ports[i]))
		apps[name] = fmt.Sprintf("http://127.0.0.1:%d", ports[i])
		args := []string{"--nats", url, "--region", name, "--type", "counter", "--kind", "http", "--app", apps[name],
			"--shards", "16", "--min-regions", "3"}
		if name == "a" {
			args = append(args, "--state-listen", stateA)
		}
		procs[name] = startShardd(t, name, args...)
	}
	waitSettled(t, nc, subjects, 60*time.Second, "a", "b", "c")

	client := natshard.NewClient(nc, natshard.WithResend(2*time.Second))
	const entities = 24
	var (
		answered atomic.Int64
		mu       sync.Mutex
		acked    = map[string]int{} // entity -> last number acknowledged
		failures []string
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	for e := range entities {
		id := fmt.Sprintf("counter-%d", e)
		wg.Go(func() {
			for seq := 1; ; seq++ {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				data, err := client.Request(ctx, "counter", id, fmt.Appendf(nil, `{"seq":%d}`, seq))
				cancel()
				var got struct{ Last int }
				if err == nil && (json.Unmarshal(data, &got) != nil || got.Last != seq) {
					err = fmt.Errorf("answered %q", data)
				}
				mu.Lock()
				if err != nil {
					failures = append(failures, fmt.Sprintf("%s %d: %v", id, seq, err))
					mu.Unlock()
					return // the entity's numbers would have a gap
				}
				acked[id] = seq
				mu.Unlock()
				answered.Add(1)
			}
		})
	}
	owners := sampleOwners(t, nc, map[string]protocol.Subjects{"counter": subjects})
	pause := func() { time.Sleep(1500 * time.Millisecond) }

	pause()
	st := waitSettled(t, nc, subjects, 30*time.Second, "a", "b", "c")
	moved := 0
	for _, s := range st.Table {
		to := map[string]string{"a": "b", "b": "c", "c": "a"}[s.Region]
		if moved < 3 && to != "" {
			t0 := time.Now()
			out, err := exec.Command(filepath.Join(binDir, "shardctl"), "--nats", url, "--type", "counter", "move", strconv.Itoa(s.Shard), to, "--wait").CombinedOutput()
			if err != nil {
				t.Fatalf("shardctl move %d %s: %v\n%s", s.Shard, to, err, out)
			}
			t.Logf("shard %d moved from %s to %s in %s", s.Shard, s.Region, to, time.Since(t0).Round(time.Millisecond))
			moved++
		}
	}
	pause()
	t0 := time.Now()
	if err := procs["c"].stop(time.Minute); err != nil {
		t.Fatalf("graceful stop of c: %v", err)
	}
	waitSettled(t, nc, subjects, 30*time.Second, "a", "b")
	t.Logf("graceful stop of c: exited and settled on a and b after %s", time.Since(t0).Round(time.Millisecond))
	pause()
	t0 = time.Now()
	procs["b"].kill()
	waitSettled(t, nc, subjects, 30*time.Second, "a")
	t.Logf("kill -9 of b: settled on a after %s", time.Since(t0).Round(time.Millisecond))
	pause()
	close(stop)
	wg.Wait()
	owners.stop()

	mu.Lock()
	defer mu.Unlock()
	if len(failures) > 0 {
		t.Fatalf("%d requests failed:\n%v", len(failures), failures)
	}
	// The apps of b and c still run: every app tells what it saw.
	var total appReport
	for _, name := range []string{"a", "b", "c"} {
		var r appReport
		if err := getJSON(apps[name]+"/violations", &r); err != nil {
			t.Fatalf("app of %s: %v", name, err)
		}
		if len(r.Violations) > 0 {
			t.Errorf("the app of %s saw the contract broken:\n%v", name, r.Violations)
		}
		t.Logf("app of %s: %d calls (%d activations, %d stops, %d messages applied, %d repeated after a resend), at most %d at once",
			name, r.Calls, r.Activations, r.Stops, r.Applied, r.Repeated, r.Peak)
		total.Applied += r.Applied
		total.Repeated += r.Repeated
	}
	// State intact: each entity's saved number is its last acknowledged.
	for id, last := range acked {
		var saved struct{ Last int }
		if err := getJSON("http://"+stateA+"/state/counter/"+id, &saved); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		if saved.Last != last {
			t.Errorf("%s: state holds %d, the last number acknowledged is %d", id, saved.Last, last)
		}
	}
	t.Logf("sidecar: %d requests to %d entities answered through 3 moves, a graceful stop and a kill -9; 0 failed; %d applied, %d repeated after a resend; single owner in %d samples",
		answered.Load(), len(acked), total.Applied, total.Repeated, owners.samples.Load())
}

func getJSON(url string, v any) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s %s", url, resp.Status, data)
	}
	return json.Unmarshal(data, v)
}
