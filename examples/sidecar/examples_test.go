// Package sidecar_test runs the sidecar examples, counter.py (Python,
// standard library only) and counter.js (Node.js, no package), as
// docs/SIDECAR.md runs them: each behind a node that hosts the type
// "counter" in it (sidecar.Run, what shardd --kind http runs).
package sidecar_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/sidecar"
)

func TestPython(t *testing.T) { testExample(t, "python3", "counter.py") }

func TestNode(t *testing.T) { testExample(t, "node", "counter.js") }

// testExample starts the example app with interpreter and a node for it,
// sends increments to 20 counters at once, checks the answers, lets the
// counters passivate, checks that they go on from their saved state, and
// reads one through the state API.
func testExample(t *testing.T, interpreter, file string) {
	path, err := exec.LookPath(interpreter)
	if err != nil {
		t.Skipf("%s is not installed (%v): the example %s is not run", interpreter, err, file)
	}
	ports := natstest.FreePorts(t, 2)
	app := exec.Command(path, file)
	app.Env = append(app.Environ(), "PORT="+strconv.Itoa(ports[0]))
	log := &natstest.Buffer{}
	app.Stdout, app.Stderr = log, log
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = app.Process.Kill()
		_ = app.Wait()
		if t.Failed() {
			t.Logf("%s's output:\n%s", file, log)
		}
	})

	url := natstest.URL(natstest.RunServer(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	stateURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	go func() {
		done <- sidecar.Run(ctx, natshard.Options{NATS: url, Region: "a", Logger: slog.New(slog.DiscardHandler)},
			sidecar.Config{App: fmt.Sprintf("http://127.0.0.1:%d", ports[0]), StateListen: stateURL[len("http://"):]},
			natshard.Type{Name: "counter", Shards: 8, IdleTimeout: 500 * time.Millisecond})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sidecar.Run: %v", err)
		}
	})

	nc := natstest.Connect(t, url)
	client := natshard.NewClient(nc)
	rctx, rcancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer rcancel()
	// Once the node made the type (once the app answered its health check).
	natstest.Eventually(t, time.Minute, "an answer of the counter type", func() error {
		ctx, cancel := context.WithTimeout(rctx, 5*time.Second)
		defer cancel()
		_, err := client.Request(ctx, "counter", "probe", []byte("0"))
		return err
	})
	const counters, increments = 20, 5
	send := func(round int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, counters)
		for c := range counters {
			wg.Go(func() {
				id := fmt.Sprintf("user.%d", c)
				for i := 1; i <= increments; i++ {
					got, err := client.Request(rctx, "counter", id, []byte(strconv.Itoa(c)))
					if want := c * (round*increments + i); err != nil || count(got) != want {
						errs <- fmt.Errorf("%s increment %d: %q %v, want count %d", id, i, got, err, want)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	send(0)
	// Idle beyond the idle timeout: the counters passivate.
	subjects := protocol.MustSubjects("", "", "counter")
	natstest.Eventually(t, time.Minute, "every counter passivated", func() error {
		m, err := nc.Request(subjects.Query("a"), []byte("{}"), 5*time.Second)
		if err != nil {
			return err
		}
		var ans protocol.QueryAnswer
		if err := json.Unmarshal(m.Data, &ans); err != nil {
			return err
		}
		active := 0
		for _, s := range ans.Shards {
			active += s.Entities
		}
		if active != 0 {
			return fmt.Errorf("%d active", active)
		}
		return nil
	})
	send(1)
	// What the app saved, through the state API, as docs/SIDECAR.md's curl.
	resp, err := http.Get(stateURL + "/state/counter/user.7")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || count(body) != 7*2*increments {
		t.Fatalf("state of user.7: %s %q", resp.Status, body)
	}
	// The app's own errors reach the requester.
	_, err = client.Request(rctx, "counter", "user.1", []byte("many"))
	if ee := (*natshard.EntityError)(nil); !errors.As(err, &ee) || ee.Message != "app: answered 400 Bad Request" {
		t.Fatalf("a bad increment: %v, want the app's 400", err)
	}
	t.Logf("%s: %d counters incremented %d times, passivated, then %d times more: every answer right", file, counters, increments, increments)
}

// count decodes {"count": n}; -1 when it is not that.
func count(data []byte) int {
	var v struct{ Count *int }
	if json.Unmarshal(data, &v) != nil || v.Count == nil {
		return -1
	}
	return *v.Count
}
