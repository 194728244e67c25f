package integration

import (
	"fmt"
	"maps"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
)

// workerRecords checks the records shardd's daemon workers publish
// (entities.Daemon: "<worker> <region> <run> start|beat <n>|stop"), in the
// order the one NATS server received them: a run's stop is published
// before the run returns and releases its claim, and the worker's next run
// starts only after that, so no worker may start a run while another of
// its runs has not stopped, except a run of a process the test killed,
// which ended with it. The test says so with its own records on the same
// subject, in the same order: "! dead <region>" once the process is gone,
// "! alive <region>" before it starts one under that region again.
type workerRecords struct {
	mu       sync.Mutex
	open     map[int]map[string]string // worker -> run -> region
	dead     map[string]bool
	overlaps []string
	bad      []string
}

func (r *workerRecords) record(m *nats.Msg) {
	f := strings.Fields(string(m.Data))
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(f) == 3 && f[0] == "!" {
		r.dead[f[2]] = f[1] == "dead"
		for _, runs := range r.open {
			maps.DeleteFunc(runs, func(_, region string) bool { return region == f[2] })
		}
		return
	}
	w, err := strconv.Atoi(f[0])
	if len(f) < 4 || err != nil {
		r.bad = append(r.bad, string(m.Data))
		return
	}
	region, run := f[1], f[2]
	if r.dead[region] {
		return // sent before its process died, received after
	}
	runs := r.open[w]
	if runs == nil {
		runs = map[string]string{}
		r.open[w] = runs
	}
	switch f[3] {
	case "start":
		if len(runs) > 0 {
			r.overlaps = append(r.overlaps, fmt.Sprintf("worker %d started in %s while it ran in %v", w, region, slices.Collect(maps.Values(runs))))
		}
		runs[run] = region
	case "stop":
		delete(runs, run)
	}
}

// exactly reports, when each of the first n workers runs once and no
// other does, how many each region runs.
func (r *workerRecords) exactly(n int) (map[string]int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	where := map[string]int{}
	for w, runs := range r.open {
		if want := w < n; want && len(runs) != 1 || !want && len(runs) != 0 {
			return nil, false
		}
		for _, region := range runs {
			where[region]++
		}
	}
	for w := range n {
		if len(r.open[w]) != 1 {
			return nil, false
		}
	}
	return where, true
}

func (r *workerRecords) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for _, w := range slices.Sorted(maps.Keys(r.open)) {
		fmt.Fprintf(&b, "%d:%v ", w, slices.Collect(maps.Values(r.open[w])))
	}
	return b.String()
}

// TestDaemonWorkersOnceAcrossProcesses (issue 31 item 9): shardd processes
// of --kind daemon keep each worker running exactly once, never two runs
// of one worker at once, through a join (the workers spread to the new
// process), a kill -9 of a process (its workers start again elsewhere,
// after its claim's lease TTL), a graceful stop, and shardctl scale both
// ways. It logs how long the workers of the killed process took to run
// again.
func TestDaemonWorkersOnceAcrossProcesses(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	const subject = "natshard.daemon.workers"
	nc := connect(t, url)
	recs := &workerRecords{open: map[int]map[string]string{}, dead: map[string]bool{}}
	if _, err := nc.Subscribe(subject, recs.record); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	mark := func(what, region string) {
		t.Helper()
		if err := nc.Publish(subject, []byte("! "+what+" "+region)); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	procs := map[string]*proc{}
	start := func(name string) {
		procs[name] = startShardd(t, name, "--nats", url, "--region", name, "--type", "workers", "--kind", "daemon",
			"--workers", "6", "--shards", "16", "--min-regions", "2")
	}
	settled := func(what string, n int, regions ...string) {
		t.Helper()
		natstest.Eventually(t, 90*time.Second, what, func() error {
			where, ok := recs.exactly(n)
			if !ok {
				return fmt.Errorf("workers: %s", recs)
			}
			lo, hi := n, 0
			for _, r := range regions {
				lo, hi = min(lo, where[r]), max(hi, where[r])
			}
			if len(where) > len(regions) || hi-lo > 1 {
				return fmt.Errorf("workers per region %v, want them spread within one over %v", where, regions)
			}
			return nil
		})
		recs.mu.Lock()
		defer recs.mu.Unlock()
		for _, o := range recs.overlaps {
			t.Error(o)
		}
		if len(recs.bad) > 0 {
			t.Errorf("records that are not a worker's: %q", recs.bad)
		}
	}
	shardctl := func(args ...string) {
		t.Helper()
		out, err := exec.Command(filepath.Join(binDir, "shardctl"), append([]string{"--nats", url, "--type", "workers"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("shardctl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		t.Logf("shardctl %s:\n%s", strings.Join(args, " "), out)
	}

	start("a")
	start("b")
	settled("6 workers on a and b", 6, "a", "b")
	start("c")
	settled("6 workers on a, b and c after c joined", 6, "a", "b", "c")

	procs["b"].kill()
	mark("dead", "b")
	t0 := time.Now()
	settled("6 workers on a and c after kill -9 of b", 6, "a", "c")
	t.Logf("the workers of b ran again elsewhere %s after its kill -9 (its claims wait a lease TTL once its registration is gone)", time.Since(t0).Round(10*time.Millisecond))

	if err := procs["c"].stop(60 * time.Second); err != nil {
		t.Fatal(err)
	}
	settled("6 workers on a after c stopped", 6, "a")

	mark("alive", "b")
	start("b")
	shardctl("scale", "9")
	settled("9 workers on a and b after scale 9", 9, "a", "b")
	shardctl("scale", "2")
	settled("2 workers after scale 2", 2, "a", "b")
	shardctl("daemon")
}
