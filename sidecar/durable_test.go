package sidecar_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/sidecar"
)

// counterApp keeps a counter per entity through the state API, as the
// contract asks in durable delivery: it reads the state, adds one, and
// writes it back compare-and-set, passing the message's Natshard-Seq on.
type counterApp struct{ t *testing.T }

func (c counterApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/healthz" || r.URL.Path[:9] != "/entities" {
		return // health, activate, stop
	}
	state := r.Header.Get(sidecar.HeaderStateURL) + "/state" + r.URL.Path[len("/entities"):]
	resp, err := http.Get(state)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	n, _ := strconv.Atoi(string(body))
	req, _ := http.NewRequest(http.MethodPut, state, bytes.NewReader([]byte(strconv.Itoa(n+1))))
	req.Header.Set("If-Match", resp.Header.Get("ETag"))
	req.Header.Set(sidecar.HeaderSeq, r.Header.Get(sidecar.HeaderSeq))
	put, err := http.DefaultClient.Do(req)
	if err != nil || put.StatusCode != http.StatusNoContent {
		http.Error(w, fmt.Sprintf("put: %v %v", err, put), http.StatusServiceUnavailable)
		return
	}
	put.Body.Close()
	fmt.Fprint(w, n+1)
}

// TestDurableExactlyOnce (issue 15, "the same exactly-once bookkeeping"):
// an app's counters, kept through the state API with Natshard-Seq, count
// every increment once though a region dies while they flow (its
// successor gets again what the dead one had not acknowledged), and
// nothing is lost.
func TestDurableExactlyOnce(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	app := serve(t, counterApp{t}, nil)
	typ := natshard.Type{Name: "count", Shards: 4, Delivery: natshard.Durable}
	start := func(region string, nc *nats.Conn) *natshard.Node {
		a := newApp(t, sidecar.Config{App: app.URL})
		n, err := natshard.Start(context.Background(), natshard.Options{Conn: nc, Region: region, Logger: quiet}, a.Type(typ))
		if err != nil {
			t.Fatal(err)
		}
		a.Attach(n)
		t.Cleanup(func() { _ = n.Close(context.Background()) })
		return n
	}
	start("a", natstest.Connect(t, url))
	ncB := natstest.Connect(t, url)
	b := start("b", ncB)
	natstest.Eventually(t, 30*time.Second, "b holds shards", func() bool { st, _ := b.Stats("count"); return len(st.Shards) > 0 })

	js := natstest.JetStream(t, natstest.Connect(t, url))
	subjects := protocol.MustSubjects("", "", "count")
	const entities, rounds = 20, 30
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range rounds {
			for i := range entities {
				if _, err := js.Publish(context.Background(), subjects.EntityOf(fmt.Sprint("c", i), 4), nil); err != nil {
					t.Error(err)
					return
				}
			}
		}
	}()
	natstest.Eventually(t, 30*time.Second, "b to handle messages", func() bool { st, _ := b.Stats("count"); return st.Delivered > 0 })
	ncB.Close() // b dies while messages flow
	<-done
	store, err := kvstate.Bind(context.Background(), js, "count", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range entities {
		natstest.Eventually(t, 30*time.Second, fmt.Sprintf("entity c%d counted %d", i, rounds), func() bool {
			data, _, err := store.LoadEntity(context.Background(), fmt.Sprint("c", i))
			return err == nil && string(data) == strconv.Itoa(rounds)
		})
	}
	// And no more come: what was given again was not applied again. A
	// last message to each, after the others: a copy still to come came
	// before it.
	for i := range entities {
		if _, err := js.Publish(context.Background(), subjects.EntityOf(fmt.Sprint("c", i), 4), nil); err != nil {
			t.Fatal(err)
		}
	}
	for i := range entities {
		natstest.Eventually(t, 30*time.Second, fmt.Sprintf("entity c%d's last message counted", i), func() error {
			data, _, err := store.LoadEntity(context.Background(), fmt.Sprint("c", i))
			if err == nil && string(data) == strconv.Itoa(rounds) {
				return errors.New("not yet")
			}
			if err != nil || string(data) != strconv.Itoa(rounds+1) {
				t.Fatalf("entity c%d: %s, %v; want %d", i, data, err, rounds+1)
			}
			return nil
		})
	}
}

// passivateApp counts each entity's activate and stop calls, and answers
// "bye" with Natshard-Passivate.
type passivateApp struct {
	mu                 sync.Mutex
	activated, stopped map[string]int
}

func (p *passivateApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(r.URL.Path, "/") // "", kind, type, id
	if len(parts) != 4 {
		return
	}
	body, _ := io.ReadAll(r.Body)
	p.mu.Lock()
	defer p.mu.Unlock()
	switch parts[1] {
	case "activate":
		p.activated[parts[3]]++
	case "stop":
		p.stopped[parts[3]]++
	case "entities":
		if string(body) == "bye" {
			w.Header().Set(sidecar.HeaderPassivate, "true")
		}
	}
}

func (p *passivateApp) counts(id string) (int, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.activated[id], p.stopped[id]
}

// TestRememberAndPassivate: an app's entity that answers with
// Natshard-Passivate is stopped (its stop call comes) and, in a type that
// remembers its entities, forgotten: when the process closes, the next
// one activates the other entities without a message, not that one.
func TestRememberAndPassivate(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	app := &passivateApp{activated: map[string]int{}, stopped: map[string]int{}}
	srv := serve(t, app, nil)
	typ := natshard.Type{Name: "rem", Shards: 4, Remember: true}
	start := func(region string) *natshard.Node {
		a := newApp(t, sidecar.Config{App: srv.URL})
		n, err := natshard.Start(context.Background(), natshard.Options{NATS: url, Region: region, Logger: quiet}, a.Type(typ))
		if err != nil {
			t.Fatal(err)
		}
		a.Attach(n)
		t.Cleanup(func() { _ = n.Close(context.Background()) })
		return n
	}
	a := start("a")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, m := range []struct{ id, body string }{{"x", "hi"}, {"y", "hi"}, {"y", "bye"}} {
		if _, err := a.Client().Request(ctx, "rem", m.id, []byte(m.body)); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Eventually(t, 30*time.Second, "y to stop", func() bool { _, stops := app.counts("y"); return stops == 1 })
	b := start("b")
	if err := a.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 30*time.Second, "x to be activated on b", func() bool { acts, _ := app.counts("x"); return acts == 2 })
	if st, _ := b.Stats("rem"); st.Restarted != 1 {
		t.Errorf("b restarted %d entities, want 1 (x)", st.Restarted)
	}
	if acts, _ := app.counts("y"); acts != 1 {
		t.Errorf("y, passivated, was activated %d times", acts)
	}
}
