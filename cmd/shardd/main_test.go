package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

func noEnv(string) string { return "" }

func TestParseConfigErrorsNameTheField(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--type", "bad type"}, nil, "--type"},
		{[]string{"--region", "a.b"}, nil, "--region"},
		{[]string{"--kind", "actor"}, nil, "--kind"},
		{[]string{"--shards", "-1"}, nil, "--shards"},
		{[]string{"--shards", "x"}, nil, "invalid value"},
		{[]string{"--replicas", "6"}, nil, "--replicas"},
		{[]string{"--routes", "nats-route://127.0.0.1:6222"}, nil, "--routes: needs --cluster"},
		{[]string{"--cluster", "127.0.0.1:6222"}, nil, "--cluster: needs --routes"},
		{[]string{"--cluster", "6222", "--routes", "nats-route://127.0.0.1:6222"}, nil, "--cluster: \"6222\" is not host:port"},
		{[]string{"--cluster", "127.0.0.1:6222", "--routes", "127.0.0.1:6222"}, nil, "--routes: \"127.0.0.1:6222\" is not a route URL"},
		{[]string{"--nats", "nats://127.0.0.1:4222", "--cluster", "127.0.0.1:6222", "--routes", "nats-route://127.0.0.1:6222"}, nil, "with --nats no embedded server"},
		{nil, map[string]string{"NATS_URL": "nats://127.0.0.1:4222", "NATSHARD_ROUTES": "nats-route://127.0.0.1:6222"}, "--cluster/--routes"},
		{[]string{"--cluster_name", "x"}, nil, "--cluster_name: only with --cluster"},
		{[]string{"--cluster-name", "x"}, nil, "--cluster_name: only with --cluster"},
		{[]string{"--lease-ttl", "1500ms"}, nil, "--lease-ttl"},
		{[]string{"--start-timeout", "0s"}, nil, "--start-timeout"},
		{nil, map[string]string{"NATSHARD_START_TIMEOUT": "later"}, "NATSHARD_START_TIMEOUT"},
		{[]string{"--log-level", "loud"}, nil, "--log-level"},
		{[]string{"--log-format", "xml"}, nil, "--log-format"},
		{[]string{"stray"}, nil, "unexpected argument"},
		{[]string{"--strategy", "random"}, nil, "--strategy"},
		{[]string{"--strategy", "least-shard:absolute=x"}, nil, "--strategy"},
		{nil, map[string]string{"NATSHARD_SHARDS": "many"}, "NATSHARD_SHARDS"},
		{nil, map[string]string{"NATSHARD_NO_COORDINATOR": "maybe"}, "NATSHARD_NO_COORDINATOR"},
		{[]string{"--auth-dir", "/nonexistent"}, nil, "--creds"}, // its region.creds
		{[]string{"--creds", "/nonexistent.creds"}, nil, "--creds"},
		{[]string{"--tls-cert", "main.go"}, nil, "--tls-key"},
		{[]string{"--tls-ca", "main.go"}, nil, "--tls-ca"}, // the embedded server needs its own certificate
		{[]string{"--no-region", "--no-coordinator"}, nil, "--no-region and --no-coordinator"},
		{[]string{"--delivery", "maybe"}, nil, "--delivery"},
		{[]string{"--remember", "--idle-timeout", "5s"}, nil, "--idle-timeout: 5s with --remember"},
		{[]string{"--remember"}, map[string]string{"NATSHARD_IDLE_TIMEOUT": "1m"}, "--idle-timeout: 1m0s with --remember"},
		{[]string{"--restart-rate", "0"}, nil, "--restart-rate"},
		{[]string{"--workers", "3"}, nil, "--workers: 3 with --kind kv"},
		{[]string{"--kind", "daemon", "--workers", "-2"}, nil, "--workers: -2 is out of range"},
		{[]string{"--kind", "daemon", "--idle-timeout", "5s"}, nil, "--idle-timeout: 5s with --kind daemon"},
		{[]string{"--kind", "daemon", "--max-active", "5"}, nil, "--max-active: 5 with --kind daemon"},
		{[]string{"--passivation-policy", "lfu"}, nil, "--passivation-policy"},
		{nil, map[string]string{"NATSHARD_PASSIVATION_POLICY": "mru"}, "--passivation-policy"},
		{[]string{"--kind", "http"}, nil, "--app: needed with --kind http"},
		{[]string{"--app", "http://127.0.0.1:8080"}, nil, `--app: only with --kind http (the kind is "kv")`},
		{nil, map[string]string{"NATSHARD_APP_TIMEOUT": "soon"}, "NATSHARD_APP_TIMEOUT"},
		{[]string{"--http", "9090"}, nil, "--http"},
		{nil, map[string]string{"NATSHARD_HTTP": "localhost"}, "--http"},
	} {
		getenv := func(k string) string { return tc.env[k] }
		_, err := parseConfig(tc.args, getenv, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %v: err %v, want one naming %q", tc.args, tc.env, err, tc.want)
		}
	}
}

func TestParseConfigEnvironment(t *testing.T) {
	env := map[string]string{"NATS_URL": "nats://x:1", "NATSHARD_TYPE": "orders", "NATSHARD_SHARDS": "64", "NATSHARD_NO_COORDINATOR": "true", "NATSHARD_IDLE_TIMEOUT": "5s"}
	c, err := parseConfig(nil, func(k string) string { return env[k] }, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if c.NATS != "nats://x:1" || c.Type != "orders" || c.Shards != 64 || !c.NoCoordinator || c.IdleTimeout != 5*time.Second {
		t.Fatalf("environment not applied: %+v", c)
	}
	// Flags win over the environment.
	c, err = parseConfig([]string{"--shards", "32"}, func(k string) string { return env[k] }, &bytes.Buffer{})
	if err != nil || c.Shards != 32 {
		t.Fatalf("flag did not win: %v %+v", err, c)
	}
	if _, err := parseConfig([]string{"--help"}, noEnv, &bytes.Buffer{}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
}

func TestVersion(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--version"}, noEnv, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "shardd ") || !strings.Contains(out.String(), runtime.Version()) {
		t.Fatalf("--version printed %q", out.String())
	}
}

func TestRunUnreachableNATS(t *testing.T) {
	err := run(context.Background(), []string{"--nats", "nats://127.0.0.1:1"}, noEnv, io.Discard, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "cannot connect to NATS at nats://127.0.0.1:1") {
		t.Fatalf("err %v", err)
	}
}

func TestRunRefusesMismatchedShardCount(t *testing.T) {
	srv := natstest.RunServer(t)
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(srv)))
	store, err := kvstate.Open(context.Background(), js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.EnsureConfig(context.Background(), protocol.TypeConfig{Shards: 128}); err != nil {
		t.Fatal(err)
	}
	err = run(context.Background(), []string{"--nats", natstest.URL(srv), "--shards", "64"}, noEnv, io.Discard, &bytes.Buffer{})
	if !errors.Is(err, kvstate.ErrConfigMismatch) || !strings.Contains(err.Error(), `type "kv": 64 shards disagree with the 128 stored for the type`) {
		t.Fatalf("err %v", err)
	}
}

// TestRunStartTimeout: shardd started on a cluster without a JetStream
// meta leader (one server of three up) waits, saying so in its log at
// INFO, until --start-timeout, then fails naming what it waited for.
func TestRunStartTimeout(t *testing.T) {
	opts := natstest.ClusterOptions(t, 3)
	url := natstest.URL(natstest.RunServerWithOptions(t, opts[0]))
	var log syncBuffer
	err := run(context.Background(), []string{"--nats", url, "--replicas", "3", "--start-timeout", "15s"}, noEnv, io.Discard, &log)
	if !errors.Is(err, natshard.ErrStartTimeout) {
		t.Fatalf("err %v; want natshard.ErrStartTimeout", err)
	}
	t.Logf("shardd: %v", err)
	for _, want := range []string{`type "kv": open its KV bucket`, "start timeout 15s", "--start-timeout", "for its KV bucket natshard_kv", "JetStream did not answer in time"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if got := log.String(); !strings.Contains(got, `level=INFO msg="waiting for JetStream" type=kv for="its KV bucket natshard_kv"`) {
		t.Errorf("the log does not say what the start waits for:\n%s", got)
	}
}

// TestRunEmbedded starts shardd with its embedded server, waits until every
// shard is served, asks an entity, and stops it gracefully.
func TestRunEmbedded(t *testing.T) {
	addr := fmt.Sprintf("127.0.0.1:%d", natstest.FreePorts(t, 1)[0])
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	logs := &natstest.Buffer{}
	go func() {
		done <- run(ctx, []string{"--listen", addr, "--data-dir", t.TempDir(), "--region", "solo", "--shards", "8"}, noEnv, io.Discard, logs)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run returned %v", err)
		}
		if t.Failed() {
			t.Logf("shardd log:\n%s", logs.String())
		}
	}()
	var nc *nats.Conn
	natstest.Eventually(t, 20*time.Second, "the embedded server up", func() error {
		var err error
		nc, err = nats.Connect("nats://" + addr)
		return err
	})
	defer nc.Close()
	subject := protocol.MustSubjects("", "", "kv").EntityOf("order-42", 8)
	natstest.Eventually(t, 20*time.Second, "an answer of the entity", func() error {
		m, err := nc.Request(subject, []byte(`{"op":"set","key":"k","value":1}`), time.Second)
		if err == nil && string(m.Data) != `{"ok":true,"value":1}` {
			t.Fatalf("answer %q", m.Data)
		}
		return err
	})
}

// TestRunStrategyStoredPerType: a process that disagrees with the
// type's stored strategy refuses to start, naming both (the library's
// tests check that one giving none adopts it).
func TestRunStrategyStoredPerType(t *testing.T) {
	srv := natstest.RunServer(t)
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(srv)))
	ctx := context.Background()
	store, err := kvstate.Open(ctx, js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	const spec = "consistent-hashing:virtual-nodes=100,limit=4"
	if _, err := store.EnsureConfig(ctx, protocol.TypeConfig{Shards: 128, Strategy: spec, Kind: "kv"}); err != nil {
		t.Fatal(err)
	}
	err = run(ctx, []string{"--nats", natstest.URL(srv), "--strategy", "least-shard"}, noEnv, io.Discard, &bytes.Buffer{})
	if !errors.Is(err, kvstate.ErrConfigMismatch) || !strings.Contains(err.Error(), `strategy "least-shard:absolute=65536,relative=1" disagrees with the type's stored strategy "consistent-hashing:virtual-nodes=100,limit=4"`) {
		t.Fatalf("err %v", err)
	}
}

// TestRunRefusesAnotherKind: a shardd hosting echo entities does not join
// a type of kv entities (it would answer their requests with echoes, and
// an acknowledged write would be lost).
func TestRunRefusesAnotherKind(t *testing.T) {
	srv := natstest.RunServer(t)
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(srv)))
	ctx := context.Background()
	store, err := kvstate.Open(ctx, js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.EnsureConfig(ctx, protocol.TypeConfig{Shards: 128, Kind: "kv"}); err != nil {
		t.Fatal(err)
	}
	err = run(ctx, []string{"--nats", natstest.URL(srv), "--kind", "echo"}, noEnv, io.Discard, &bytes.Buffer{})
	if !errors.Is(err, kvstate.ErrConfigMismatch) || !strings.Contains(err.Error(), `this process hosts entity kind "echo", the type's entities are of kind "kv"`) {
		t.Fatalf("err %v", err)
	}
}

// TestDefaultsAreTheLibrarys: shardd with no flag hosts its type exactly
// as the library hosts a Type that gives only a name and entities, on
// Options that give nothing: the same defaults, and the same meaning of
// "auto" (chosen from the server) and of zero.
func TestDefaultsAreTheLibrarys(t *testing.T) {
	cfg, err := parseConfig(nil, noEnv, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	opts, typ, err := cfg.natshard(nil)
	if err != nil {
		t.Fatal(err)
	}
	if typ.Entity == nil {
		t.Fatal("no entity factory for the default kind")
	}
	typ.Entity = nil
	lib := natshard.Type{Name: typ.Name, Kind: typ.Kind}
	if got, want := typ.Defaults(), lib.Defaults(); !reflect.DeepEqual(got, want) {
		t.Errorf("shardd's type\n%+v\nthe library's\n%+v", got, want)
	}
	// The library's defaults of these are zero (or chosen from the
	// environment): shardd must leave them so.
	want := natshard.Options{
		Region:     natshard.DefaultRegion(),
		Server:     natshard.ServerOptions{Listen: natshard.DefaultListen, DataDir: natshard.DefaultDataDir()},
		DataPrefix: protocol.DefaultDataPrefix, ControlPrefix: protocol.DefaultControlPrefix,
	}
	if opts.Region != want.Region || opts.Name != "shardd "+opts.Region || !reflect.DeepEqual(opts.Server, want.Server) || opts.LeaseTTL != 0 || opts.ReleaseGrace != 0 ||
		opts.DataPrefix != want.DataPrefix || opts.ControlPrefix != want.ControlPrefix || opts.NATS != "" || opts.NoCoordinator ||
		opts.StartTimeout != natshard.DefaultStartTimeout {
		t.Errorf("shardd's options %+v, want the library's defaults %+v", opts, want)
	}
	// shardd's 0 means never (or none) where the library's zero means the
	// default.
	cfg, err = parseConfig([]string{"--idle-timeout", "0", "--rebalance-interval", "0", "--release-grace", "0"}, noEnv, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	opts, typ, _ = cfg.natshard(nil)
	if typ.IdleTimeout != natshard.Off || typ.RebalanceInterval != natshard.Off || opts.ReleaseGrace != natshard.Off {
		t.Errorf("shardd's 0: idle %v, rebalance %v, grace %v; want natshard.Off", typ.IdleTimeout, typ.RebalanceInterval, opts.ReleaseGrace)
	}
	// --remember drops the idle timeout's default.
	cfg, err = parseConfig([]string{"--remember", "--restart-rate", "50"}, noEnv, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	_, typ, _ = cfg.natshard(nil)
	if !typ.Remember || typ.IdleTimeout != natshard.Off || typ.RestartRate != 50 {
		t.Errorf("--remember: remember %v, idle %v, restart rate %d", typ.Remember, typ.IdleTimeout, typ.RestartRate)
	}
}

// TestRunSidecar: with --kind http the entities are the app's: a request
// is answered by the app; an app URL that is not http is refused before
// anything starts; an app that never answers its health check is waited
// for, saying so in the log, and no region registers meanwhile.
func TestRunSidecar(t *testing.T) {
	srv := natstest.RunServer(t)
	url := natstest.URL(srv)
	app := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/entities/") {
			body, _ := io.ReadAll(r.Body)
			fmt.Fprintf(w, "%s says %s", strings.TrimPrefix(r.URL.Path, "/entities/"), body)
		}
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go app.Serve(ln)
	defer app.Close()

	err = run(context.Background(), []string{"--nats", url, "--kind", "http", "--app", "ftp://127.0.0.1:21"}, noEnv, io.Discard, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), `the app URL "ftp://127.0.0.1:21" is not an http:// or https:// URL`) {
		t.Fatalf("ftp app: %v", err)
	}

	logs := &natstest.Buffer{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := run(ctx, []string{"--nats", url, "--kind", "http", "--type", "up", "--app", "http://127.0.0.1:1"}, noEnv, io.Discard, logs); err != nil {
		t.Fatalf("stopped while waiting for the app: %v", err)
	}
	if !strings.Contains(logs.String(), "waiting for the app to answer its health check") || !strings.Contains(logs.String(), "connection refused") {
		t.Fatalf("log while waiting for an unreachable app:\n%s", logs)
	}
	if strings.Contains(logs.String(), "hosting type") {
		t.Fatalf("a type hosted before the app answered:\n%s", logs)
	}

	ctx, cancel = context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--nats", url, "--kind", "http", "--type", "up", "--shards", "4", "--app", "http://" + ln.Addr().String()}, noEnv, io.Discard, io.Discard)
	}()
	nc := natstest.Connect(t, url)
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	natstest.Eventually(t, 30*time.Second, "an answer once shardd made the type", func() error {
		got, err := natshard.NewClient(nc).Request(rctx, "up", "alice", []byte("hi"))
		if errors.Is(err, natshard.ErrUnknownType) {
			return err
		}
		if err != nil || string(got) != "up/alice says hi" {
			t.Fatalf("answer %q, %v", got, err)
		}
		return nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run returned %v", err)
	}
}

var update = flag.Bool("update", false, "rewrite testdata/*.golden with the output of this run")

// TestHelpTranscript: shardd --help, as operators read it, against
// testdata/help.golden (go test ./cmd/shardd -run TestHelpTranscript
// -update rewrites it). The defaults that depend on the machine come from
// the environment here.
func TestHelpTranscript(t *testing.T) {
	env := map[string]string{"NATSHARD_REGION": "myhost-12345", "NATSHARD_DATA_DIR": "/home/me/.local/state/natshard"}
	var out bytes.Buffer
	err := run(context.Background(), []string{"--help"}, func(k string) string { return env[k] }, &out, io.Discard)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	got := "$ shardd --help\n" + out.String()
	file := filepath.Join("testdata", "help.golden")
	if *update {
		if err := os.WriteFile(file, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("shardd --help differs from %s (-update rewrites it):\n%s", file, got)
	}
}

// TestJSONLogDurations: a JSON log line says durations as people read
// them, whoever logged them.
func TestJSONLogDurations(t *testing.T) {
	var out bytes.Buffer
	log := newLogger(config{LogLevel: "info", LogFormat: "json"}, &out)
	log.Info("took", "wait", 1500*time.Millisecond, slog.Group("g", "d", 2*time.Millisecond))
	var line map[string]any
	if err := json.Unmarshal(out.Bytes(), &line); err != nil {
		t.Fatal(err)
	}
	if line["wait"] != "1.5s" || line["g"].(map[string]any)["d"] != "2ms" {
		t.Fatalf("JSON line %s", out.Bytes())
	}
}

// TestRunHTTP: shardd --http serves the probes from before its node
// registered until it stopped, /metrics with natshard's metrics and Go's,
// and the shard map; /readyz turns 200 once the region serves.
func TestRunHTTP(t *testing.T) {
	ports := natstest.FreePorts(t, 2)
	addr, web := fmt.Sprintf("127.0.0.1:%d", ports[0]), fmt.Sprintf("127.0.0.1:%d", ports[1])
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	logs := &natstest.Buffer{}
	go func() {
		done <- run(ctx, []string{"--listen", addr, "--data-dir", t.TempDir(), "--region", "solo", "--shards", "8", "--http", web, "--log-format", "json"}, noEnv, io.Discard, logs)
	}()
	stopped := false
	defer func() {
		if !stopped {
			cancel()
			<-done
		}
		if t.Failed() {
			t.Logf("shardd log:\n%s", logs.String())
		}
	}()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + web + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	natstest.Eventually(t, 30*time.Second, "/readyz ready", func() error {
		code, body := get("/readyz")
		if code != 0 && code != http.StatusOK && code != http.StatusServiceUnavailable {
			t.Fatalf("/readyz: %d %s", code, body)
		}
		if code != http.StatusOK {
			return fmt.Errorf("%d %s", code, body)
		}
		return nil
	})
	if code, body := get("/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/healthz: %d %q", code, body)
	}
	// Ready means serving what the region was given: the coordinator may
	// not have given it all eight shards yet, so /metrics is read until
	// they are live.
	wants := []string{`natshard_region_shards{mode="live",region="solo",type="kv"} 8`, `natshard_coordinator_leader{region="solo",type="kv"} 1`, "go_goroutines ", "process_resident_memory_bytes ", "go_build_info{"}
	natstest.Eventually(t, 30*time.Second, "every line wanted in /metrics", func() error {
		code, body := get("/metrics")
		if code != http.StatusOK {
			t.Fatalf("/metrics: %d", code)
		}
		var missing []string
		for _, want := range wants {
			if !strings.Contains(body, want) {
				missing = append(missing, want)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("lacks %q", missing)
		}
		return nil
	})
	if code, body := get("/ui/"); code != http.StatusOK || !strings.Contains(body, "<title>natshard shard map</title>") {
		t.Errorf("/ui/: %d %.200s", code, body)
	}
	if code, body := get("/ui/api/status?type=kv"); code != http.StatusOK || !strings.Contains(body, `"coordinator":{"region":"solo"`) {
		t.Errorf("/ui/api/status: %d %s", code, body)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("run returned %v", err)
	}
	stopped = true
	if code, _ := get("/healthz"); code != 0 {
		t.Errorf("the listener outlived shardd: /healthz answered %d", code)
	}
	if !strings.Contains(logs.String(), `"msg":"HTTP listening: /metrics, /healthz, /readyz, /ui/","addr":"`+web+`"`) {
		t.Errorf("no log line of the listener")
	}
}

// syncBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
