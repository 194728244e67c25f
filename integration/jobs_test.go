package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/jobs"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestJobsFullRestart (issue 13: "full restart: remembered entities
// running again, reminders fire once") runs two processes of the example
// program examples/jobs (durable delivery, remembered entities, a
// reminder per step) on a NATS server of its own, starts jobs, and kills
// every process, the server included, with -9 while the jobs' steps fall
// due; then starts them all again on the same store. It proves: every
// job that ran runs again without a message (its heartbeat comes back:
// it was remembered and restarted), and every job does each of its steps
// exactly once, in order: no reminder was lost or came twice, and none
// was applied twice, though some fell due while everything was down and
// others were being handled when the processes died.
func TestJobsFullRestart(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	natsArgs := []string{"-js", "-sd", t.TempDir(), "-a", "127.0.0.1", "-p", fmt.Sprint(port)}
	server := startProcess(t, "nats-server", "nats", natsArgs...)
	start := func(name string) *proc { return startProcess(t, "jobs", name, "-nats", url, "-region", name) }
	nc := connect(t, url) // the server is up: a job process does not wait for it
	procs := []*proc{start("a"), start("b")}
	subjects := protocol.MustSubjects("", "", "job")
	waitSettled(t, nc, subjects, 60*time.Second, "a", "b")

	const steps = 6
	var short, long []string
	for i := range 20 {
		short = append(short, fmt.Sprintf("short-%d", i))
	}
	for i := range 10 {
		long = append(long, fmt.Sprintf("long-%d", i))
	}
	ask := func(nc *nats.Conn, id string, req jobs.Request) (jobs.Job, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return jobs.Key.Ref(natshard.NewClient(nc), id).Ask(ctx, req)
	}
	for _, id := range short {
		if _, err := ask(nc, id, jobs.Request{Op: "start", Steps: steps, Every: jobs.Duration(2 * time.Second)}); err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
	}
	for _, id := range long {
		if _, err := ask(nc, id, jobs.Request{Op: "start", Steps: 1, Every: jobs.Duration(time.Hour)}); err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
	}
	// A few steps are done; then every process dies at once, and more
	// steps fall due while they are down.
	natstest.Eventually(t, 60*time.Second, "a step of every short job", func() error {
		for _, id := range short {
			if j, err := ask(nc, id, jobs.Request{Op: "get"}); err != nil || len(j.Done) == 0 {
				return fmt.Errorf("%s: done %v, %v", id, j.Done, err)
			}
		}
		return nil
	})
	for _, p := range procs {
		p.kill()
	}
	server.kill()
	time.Sleep(3 * time.Second) // down while steps fall due: the fault itself, not a wait for a result

	startProcess(t, "nats-server", "nats", natsArgs...)
	nc = connect(t, url)
	var (
		mu   sync.Mutex
		seen = map[string]time.Time{}
	)
	restarted := time.Now()
	sub, err := nc.Subscribe(jobs.RunningSubject("*"), func(m *nats.Msg) {
		mu.Lock()
		if id := strings.TrimPrefix(m.Subject, jobs.RunningSubject("")); seen[id].IsZero() {
			seen[id] = time.Now()
		}
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	start("a")
	start("b")
	waitSettled(t, nc, subjects, 90*time.Second, "a", "b")

	// The long jobs run again, though nobody sent them anything.
	natstest.Eventually(t, 60*time.Second, "every long job to run again", func() error {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range long {
			if seen[id].IsZero() {
				return fmt.Errorf("no heartbeat of %s since the restart", id)
			}
		}
		return nil
	})
	mu.Lock()
	var last time.Time
	for _, id := range long {
		if seen[id].After(last) {
			last = seen[id]
		}
	}
	mu.Unlock()
	t.Logf("full restart of the jobs: every remembered job ran again %s after the processes started", last.Sub(restarted).Round(time.Millisecond))

	// Every step of every job, once, in order.
	want := make([]int, steps)
	for i := range want {
		want[i] = i + 1
	}
	natstest.Eventually(t, 90*time.Second, "every short job to finish", func() error {
		for _, id := range short {
			j, err := ask(nc, id, jobs.Request{Op: "get"})
			if err != nil {
				return fmt.Errorf("%s: %w", id, err)
			}
			if len(j.Done) < steps {
				return fmt.Errorf("%s has done steps %v", id, j.Done)
			}
		}
		return nil
	})
	for _, id := range short {
		j, err := ask(nc, id, jobs.Request{Op: "get"})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(j.Done, want) || !slices.Equal(j.Fired, want) {
			t.Errorf("%s: done %v, reminders %v; want each step once, in order", id, j.Done, j.Fired)
		}
	}
	for _, id := range long {
		if j, err := ask(nc, id, jobs.Request{Op: "get"}); err != nil || len(j.Fired) != 0 {
			t.Errorf("%s: %+v, %v; its step is an hour away", id, j, err)
		}
	}
}
