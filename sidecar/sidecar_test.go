package sidecar_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/sidecar"
)

var quiet = slog.New(slog.DiscardHandler)

// recApp is an app in Go that checks what the contract promises: an
// entity's calls come one at a time (activate, messages, stop), messages
// only to an active entity, numbered messages in order, each with its key
// (Natshard-Msg-Id: the test's messages all come from natshard.Client);
// and it keeps a
// counter per entity through the state API (loaded at activation, written
// with If-Match at every message). It counts its calls in flight and its
// open connections.
type recApp struct {
	mu          sync.Mutex
	busy        map[string]bool      // entity -> a call is running
	cache       map[string]*counter  // active entities
	violations  []string             // what broke the contract
	inFlight    int                  // calls running now
	peak        int                  // most calls running at once
	activations int                  // activate calls answered
	stops       int                  // stop calls answered
	conns       atomic.Int64         // connections open now
	srv         *testServer          // its server
	stateURLs   map[string]time.Time // Natshard-State-Url values seen
}

type counter struct {
	Count int `json:"count"`
	Last  int `json:"last"`
	etag  string
}

type testServer struct {
	*http.Server
	URL string
	ln  net.Listener
}

// serve starts an HTTP server for h on a free loopback port, counting its
// open connections in conns (when not nil).
func serve(t testing.TB, h http.Handler, conns *atomic.Int64) *testServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &testServer{Server: &http.Server{Handler: h, ErrorLog: slog.NewLogLogger(slog.DiscardHandler, 0)}, URL: "http://" + ln.Addr().String(), ln: ln}
	if conns != nil {
		s.ConnState = func(_ net.Conn, st http.ConnState) {
			switch st {
			case http.StateNew:
				conns.Add(1)
			case http.StateClosed, http.StateHijacked:
				conns.Add(-1)
			}
		}
	}
	go s.Serve(ln)
	t.Cleanup(func() { s.Close() })
	return s
}

func newRecApp(t *testing.T) *recApp {
	a := &recApp{busy: map[string]bool{}, cache: map[string]*counter{}, stateURLs: map[string]time.Time{}}
	a.srv = serve(t, a, &a.conns)
	return a
}

func (a *recApp) violate(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.violations) < 20 {
		a.violations = append(a.violations, fmt.Sprintf(format, args...))
	}
}

func (a *recApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/healthz" {
		return
	}
	parts := strings.SplitN(r.URL.EscapedPath(), "/", 4) // "", kind, type, escaped id
	if len(parts) != 4 {
		http.NotFound(w, r)
		return
	}
	kind, key := parts[1], parts[2]+"/"+parts[3]
	body, _ := io.ReadAll(r.Body)
	stateURL := r.Header.Get(sidecar.HeaderStateURL) + "/state/" + key

	a.mu.Lock()
	if a.busy[key] {
		a.violations = append(a.violations, fmt.Sprintf("%s: %s while another call of the entity runs", key, kind))
	}
	a.busy[key] = true
	a.inFlight++
	a.peak = max(a.peak, a.inFlight)
	c := a.cache[key]
	a.stateURLs[r.Header.Get(sidecar.HeaderStateURL)] = time.Now()
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.busy[key] = false
		a.inFlight--
		a.mu.Unlock()
	}()
	time.Sleep(200 * time.Microsecond) // room for an overlap, were there one

	switch kind {
	case "activate":
		if c != nil {
			a.violate("%s activated twice", key)
		}
		c = &counter{}
		resp, err := http.Get(stateURL)
		if err != nil {
			a.violate("%s: state API: %v", key, err)
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		c.etag = resp.Header.Get("ETag")
		if resp.StatusCode == http.StatusOK {
			if err := json.Unmarshal(data, c); err != nil {
				a.violate("%s: state %q: %v", key, data, err)
			}
		}
		a.mu.Lock()
		a.cache[key] = c
		a.activations++
		a.mu.Unlock()
	case "stop":
		if c == nil {
			a.violate("%s stopped while not active", key)
		}
		a.mu.Lock()
		delete(a.cache, key)
		a.stops++
		a.mu.Unlock()
	case "entities":
		// natshard.Client gives every message a key: a publish its
		// Nats-Msg-Id, a request its reply subject (and no header).
		if r.Header.Get(sidecar.HeaderMsgID) == "" {
			a.violate("%s: a message (%q) without %s", key, body, sidecar.HeaderMsgID)
		}
		if c == nil {
			a.violate("%s: a message while not active", key)
			http.Error(w, "not active", http.StatusConflict)
			return
		}
		seq, err := strconv.Atoi(string(body))
		if err != nil {
			w.Write(fmt.Appendf(nil, `{"count":%d,"last":%d}`, c.Count, c.Last)) // a read
			return
		}
		if seq != c.Last+1 {
			a.violate("%s: message %d after %d", key, seq, c.Last)
		}
		next := counter{Count: c.Count + 1, Last: seq}
		data := fmt.Appendf(nil, `{"count":%d,"last":%d}`, next.Count, next.Last)
		req, _ := http.NewRequest(http.MethodPut, stateURL, bytes.NewReader(data))
		req.Header.Set("If-Match", c.etag)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			a.violate("%s: state write answered %s", key, resp.Status)
			http.Error(w, resp.Status, http.StatusBadGateway)
			return
		}
		c.Count, c.Last, c.etag = next.Count, next.Last, resp.Header.Get("ETag")
		w.Write(data)
	default:
		http.NotFound(w, r)
	}
}

func (a *recApp) check(t *testing.T) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.violations) > 0 {
		t.Fatalf("the app saw the contract broken:\n%s", strings.Join(a.violations, "\n"))
	}
}

// startNode starts a node on the server at url hosting the app's type t,
// attached to the app; both are closed at the end of the test (the node
// first).
func startNode(t *testing.T, url string, app *sidecar.App, t0 natshard.Type) *natshard.Node {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "a", Logger: quiet}, app.Type(t0))
	if err != nil {
		t.Fatal(err)
	}
	app.Attach(n)
	t.Cleanup(func() {
		_ = n.Close(context.Background())
		_ = app.Close()
	})
	return n
}

func newApp(t *testing.T, cfg sidecar.Config) *sidecar.App {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	a, err := sidecar.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	return a
}

// TestTurnTakingAndOrder: numbered messages published to 40 entities at
// once reach the app one call at a time per entity, in order, after the
// entity's activation and before its stop, concurrently across entities
// but never more than Concurrency at once; each entity's counter, kept
// through the state API, survives passivation (stop, then activation
// again, which reloads it).
func TestTurnTakingAndOrder(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	rec := newRecApp(t)
	const concurrency, entities, perRound = 4, 40, 50
	app := newApp(t, sidecar.Config{App: rec.srv.URL, Concurrency: concurrency})
	node := startNode(t, url, app, natshard.Type{Name: "counter", Shards: 8, IdleTimeout: 300 * time.Millisecond})
	client := node.Client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for round := range 2 {
		// A request per entity first: publishes are not retried while no
		// region serves a shard yet.
		for i := range entities {
			if _, err := client.Request(ctx, "counter", fmt.Sprintf("e-%d", i), []byte("read")); err != nil {
				t.Fatal(err)
			}
		}
		for seq := round*perRound + 1; seq <= (round+1)*perRound; seq++ {
			for i := range entities {
				if err := client.Publish(ctx, "counter", fmt.Sprintf("e-%d", i), []byte(strconv.Itoa(seq))); err != nil {
					t.Fatal(err)
				}
			}
		}
		want := fmt.Sprintf(`{"count":%d,"last":%d}`, (round+1)*perRound, (round+1)*perRound)
		for i := range entities {
			got, err := client.Request(ctx, "counter", fmt.Sprintf("e-%d", i), []byte("read"))
			if err != nil || string(got) != want {
				t.Fatalf("e-%d after round %d: %s %v, want %s", i, round, got, err, want)
			}
		}
		// Passivated: every entity stopped; the next round activates
		// them again, from their saved state.
		natstest.Eventually(t, 30*time.Second, "every entity passivated", func() bool {
			rec.mu.Lock()
			defer rec.mu.Unlock()
			return rec.stops == rec.activations && len(rec.cache) == 0
		})
		rec.check(t)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	t.Logf("%d activations, %d stops, at most %d calls in flight (limit %d), %d connections open",
		rec.activations, rec.stops, rec.peak, concurrency, rec.conns.Load())
	if rec.peak > concurrency {
		t.Fatalf("%d calls in flight at once, more than the limit %d", rec.peak, concurrency)
	}
	if rec.peak < 2 {
		t.Fatalf("at most %d call in flight: entities did not run concurrently", rec.peak)
	}
	if rec.activations < 2*entities {
		t.Fatalf("%d activations of %d entities in 2 rounds", rec.activations, entities)
	}
	// The calls' connections, and the health checks' own.
	if n := rec.conns.Load(); n > concurrency+1 {
		t.Fatalf("%d connections open to the app, more than the limit %d and the health check's", n, concurrency)
	}
	if len(rec.stateURLs) != 1 || rec.stateURLs[app.StateURL()].IsZero() {
		t.Fatalf("state URLs given: %v, want %s", rec.stateURLs, app.StateURL())
	}
}

// TestConfig: misconfiguration is refused with an error that says what is
// wrong.
func TestConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg  sidecar.Config
		want string
	}{
		{sidecar.Config{}, "no app URL given"},
		{sidecar.Config{App: "ftp://127.0.0.1:21"}, `the app URL "ftp://127.0.0.1:21" is not an http:// or https:// URL`},
		{sidecar.Config{App: "127.0.0.1:8080"}, "is not an http:// or https:// URL"},
		{sidecar.Config{App: "http://127.0.0.1:8080/?x=1"}, "has a user, a query or a fragment"},
		{sidecar.Config{App: "http://127.0.0.1:8080", Concurrency: -1}, "the app concurrency -1 is less than 1"},
		{sidecar.Config{App: "http://127.0.0.1:8080", Timeout: -time.Second}, "negative app timeout"},
		{sidecar.Config{App: "http://127.0.0.1:8080", StateListen: ":0"}, `the state API address ":0" is not a loopback address`},
		{sidecar.Config{App: "http://127.0.0.1:8080", StateListen: "0.0.0.0:0"}, "not a loopback address"},
		{sidecar.Config{App: "http://127.0.0.1:8080", StateListen: "127.0.0.1"}, "is not host:port"},
	} {
		tc.cfg.Logger = quiet
		a, err := sidecar.New(tc.cfg)
		if err == nil {
			a.Close()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error saying %q", tc.cfg, err, tc.want)
		}
	}
}

// TestStateAPI: reads and compare-and-set writes of an entity's state,
// the same state the type's entities see in natshard (Node.StateStore),
// and the errors: no precondition, a stale one, an unknown type, a bad
// id, a state too large.
func TestStateAPI(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	rec := newRecApp(t)
	app := newApp(t, sidecar.Config{App: rec.srv.URL})
	node := startNode(t, url, app, natshard.Type{Name: "docs", Shards: 4})
	base := app.StateURL() + "/state/docs/"
	do := func(method, id, body string, h ...string) (int, string, string) {
		t.Helper()
		req, err := http.NewRequest(method, base+id, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i+1 < len(h); i += 2 {
			req.Header.Set(h[i], h[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("ETag"), string(data)
	}
	expect := func(what string, code int, wantCode int, body, wantBody string) {
		t.Helper()
		if code != wantCode || !strings.Contains(body, wantBody) {
			t.Fatalf("%s: %d %q, want %d with %q", what, code, body, wantCode, wantBody)
		}
	}
	code, tag, body := do("GET", "alice", "")
	expect("GET of no state", code, 404, body, `has no state`)
	if tag != `"0"` {
		t.Fatalf("GET of no state: ETag %s, want \"0\"", tag)
	}
	code, _, body = do("PUT", "alice", "v1")
	expect("PUT without precondition", code, 428, body, "compare-and-set")
	code, tag1, _ := do("PUT", "alice", "v1", "If-Match", `"0"`)
	expect("PUT If-Match 0", code, 204, "", "")
	code, _, body = do("PUT", "alice", "v1 again", "If-None-Match", "*")
	expect("PUT If-None-Match * over a state", code, 412, body, "another write came first")
	code, tag, body = do("GET", "alice", "")
	expect("GET", code, 200, body, "v1")
	if tag != tag1 {
		t.Fatalf("GET's ETag %s, PUT's %s", tag, tag1)
	}
	code, tag2, _ := do("PUT", "alice", "v2", "If-Match", tag1)
	expect("PUT If-Match current", code, 204, "", "")
	code, _, body = do("PUT", "alice", "v3", "If-Match", tag1)
	expect("PUT If-Match stale", code, 412, body, "read it again")
	// The same state as natshard's entities see.
	store, _ := node.StateStore("docs")
	data, rev, err := store.LoadEntity(context.Background(), "alice")
	if err != nil || string(data) != "v2" || `"`+strconv.FormatUint(rev, 10)+`"` != tag2 {
		t.Fatalf("natshard's store: %q at %d, %v; the API's ETag %s", data, rev, err, tag2)
	}
	code, _, body = do("DELETE", "alice", "", "If-Match", tag1)
	expect("DELETE If-Match stale", code, 412, body, "")
	code, _, _ = do("DELETE", "alice", "", "If-Match", tag2)
	expect("DELETE If-Match current", code, 204, "", "")
	code, _, _ = do("GET", "alice", "")
	expect("GET after DELETE", code, 404, "", "")
	code, _, _ = do("PUT", "alice", "v4", "If-None-Match", "*")
	expect("PUT If-None-Match * after DELETE", code, 204, "", "")

	// Ids are escaped path segments; a dot is a token separator.
	code, _, _ = do("PUT", url2("user/1.x"), "{}", "If-Match", `"0"`)
	expect("PUT of an escaped id", code, 204, "", "")
	if data, _, err := store.LoadEntity(context.Background(), "user/1.x"); err != nil || string(data) != "{}" {
		t.Fatalf("escaped id stored as %q, %v", data, err)
	}
	code, _, body = do("GET", "a..b", "")
	expect("GET of a bad id", code, 400, body, "empty token")
	code, _, body = do("PUT", "bob", "x", "If-Match", "soon")
	expect("PUT with a bad If-Match", code, 400, body, "is not an ETag")
	code, _, body = do("PUT", "bob", strings.Repeat("x", 1<<20), "If-Match", `"0"`)
	expect("PUT of a state too large", code, 413, body, "at most")
	resp, err := http.Get(app.StateURL() + "/state/other/alice")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Fatalf("GET of a type that is not the app's: %s", resp.Status)
	}
	resp, err = http.Post(base+"alice", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Fatalf("POST: %s", resp.Status)
	}
}

func url2(id string) string { return url.PathEscape(id) }
