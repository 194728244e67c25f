package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
		{[]string{"--replicas", "0"}, nil, "--replicas"},
		{[]string{"--lease-ttl", "1500ms"}, nil, "--lease-ttl"},
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

func TestRunUnreachableNATS(t *testing.T) {
	err := run(context.Background(), []string{"--nats", "nats://127.0.0.1:1"}, noEnv, &bytes.Buffer{})
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
	err = run(context.Background(), []string{"--nats", natstest.URL(srv), "--shards", "64"}, noEnv, &bytes.Buffer{})
	if !errors.Is(err, kvstate.ErrConfigMismatch) || !strings.Contains(err.Error(), "--shards 64 disagrees with the type's stored shard count 128") {
		t.Fatalf("err %v", err)
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
		done <- run(ctx, []string{"--listen", addr, "--data-dir", t.TempDir(), "--region", "solo", "--shards", "8"}, noEnv, logs)
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
	deadline := time.Now().Add(20 * time.Second)
	for {
		var err error
		if nc, err = nats.Connect("nats://" + addr); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("embedded server never came up: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer nc.Close()
	subject := protocol.MustSubjects("", "", "kv").EntityOf("order-42", 8)
	for {
		m, err := nc.Request(subject, []byte(`{"op":"set","key":"k","value":1}`), time.Second)
		if err == nil {
			if string(m.Data) != `{"ok":true,"value":1}` {
				t.Fatalf("answer %q", m.Data)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("entity never answered: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestRunStrategyStoredPerType(t *testing.T) {
	srv := natstest.RunServer(t)
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(srv)))
	ctx := context.Background()
	store, err := kvstate.Open(ctx, js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// A new type stores the strategy it was given (parseConfig makes the
	// flag canonical).
	const spec = "consistent-hashing:virtual-nodes=100,limit=4"
	got, err := ensureConfig(ctx, store, 0, spec)
	if err != nil || got.Shards != 128 || got.Strategy != spec {
		t.Fatalf("new type: %+v %v", got, err)
	}
	// A process without --strategy adopts the stored one.
	if got, err = ensureConfig(ctx, store, 0, ""); err != nil || got.Strategy != spec {
		t.Fatalf("adopt: %+v %v", got, err)
	}
	// A process that disagrees refuses to start, naming both.
	err = run(ctx, []string{"--nats", natstest.URL(srv), "--strategy", "least-shard"}, noEnv, &bytes.Buffer{})
	if !errors.Is(err, kvstate.ErrConfigMismatch) || !strings.Contains(err.Error(), `--strategy "least-shard:absolute=20,relative=0.1" disagrees with the type's stored strategy "consistent-hashing:virtual-nodes=100,limit=4"`) {
		t.Fatalf("err %v", err)
	}
}

// TestReleaseGrace: --release-grace auto is none on a standalone server and
// the default on a cluster; an explicit value wins; 0 is none (not the
// library's default).
func TestReleaseGrace(t *testing.T) {
	for _, c := range []struct {
		flag    string
		cluster string
		want    time.Duration
	}{
		{"auto", "", -1},
		{"auto", "east", time.Second},
		{"250ms", "", 250 * time.Millisecond},
		{"250ms", "east", 250 * time.Millisecond},
		{"0s", "east", -1},
	} {
		var g time.Duration
		if err := (*autoFlag)(&g).Set(c.flag); err != nil {
			t.Fatalf("Set(%q): %v", c.flag, err)
		}
		if got := releaseGrace(g, c.cluster); got != c.want {
			t.Errorf("--release-grace %s on cluster %q: %v, want %v", c.flag, c.cluster, got, c.want)
		}
	}
	var g time.Duration
	if err := (*autoFlag)(&g).Set("soon"); err == nil {
		t.Error("--release-grace soon accepted")
	}
}

// TestLeaseTTL: --lease-ttl auto is 4s on a standalone server and 15s on a
// cluster; an explicit value wins.
func TestLeaseTTL(t *testing.T) {
	for _, c := range []struct {
		flag    string
		cluster string
		want    time.Duration
	}{
		{"auto", "", 4 * time.Second},
		{"auto", "east", 15 * time.Second},
		{"6s", "", 6 * time.Second},
		{"6s", "east", 6 * time.Second},
	} {
		var ttl time.Duration
		if err := (*autoFlag)(&ttl).Set(c.flag); err != nil {
			t.Fatalf("Set(%q): %v", c.flag, err)
		}
		if got := leaseTTL(ttl, c.cluster); got != c.want {
			t.Errorf("--lease-ttl %s on cluster %q: %v, want %v", c.flag, c.cluster, got, c.want)
		}
	}
}
