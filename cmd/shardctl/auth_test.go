package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

func TestAuthCommands(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	sh := func(args ...string) (string, string, error) {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), args, func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
		return stdout.String(), stderr.String(), err
	}
	out, _, err := sh("--type", "orders", "auth", "init", "--dir", dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"types: orders", filepath.Join(dir, "region.creds"), "shardd --auth-dir " + dir, "resolver_preload", "operator: "} {
		if !strings.Contains(out, want) {
			t.Errorf("auth init output lacks %q:\n%s", want, out)
		}
	}
	if _, _, err := sh("auth", "init", "--dir", dir); exitCode(err) != 1 || !strings.Contains(err.Error(), "never overwritten") {
		t.Errorf("second init: %v", err)
	}
	if out, _, err := sh("auth", "user", "region", "r2", "--dir", dir, "--types", "kv"); err != nil || !strings.Contains(out, "r2.creds") {
		t.Errorf("auth user: %q %v", out, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "r2.creds")); err != nil {
		t.Error(err)
	}
	for _, args := range [][]string{
		{"auth"},
		{"auth", "frobnicate"},
		{"auth", "init", "extra"},
		{"auth", "user", "region"},
		{"auth", "user", "root", "x", "--dir", dir},
		{"--creds", filepath.Join(dir, "missing.creds"), "status"},
		{"--tls-cert", filepath.Join(dir, "admin.creds"), "status"},
	} {
		if _, _, err := sh(args...); !errors.Is(err, errUsage) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}

// TestPermissionErrors: on a server in operator mode, what the server
// refuses is reported as a permission error that names the refused
// subject, the admin role the command needs, and the role of the
// credentials used (instead of a timeout, or a view read from KV as if no
// coordinator ran).
func TestPermissionErrors(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	st, err := auth.Init(dir, auth.Scope{Types: []string{"kv"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := auth.AddUser(dir, auth.Admin, "admin-other", auth.Scope{Types: []string{"other"}}); err != nil {
		t.Fatal(err)
	}
	creds := func(name string) string { return filepath.Join(dir, name+".creds") }
	opts := natstest.DefaultOptions(t)
	if err := st.ConfigureServer(opts); err != nil {
		t.Fatal(err)
	}
	url := natstest.URL(natstest.RunServerWithOptions(t, opts))
	// The type exists: a region user made it.
	ropts, err := auth.Client{Creds: creds("region")}.Options()
	if err != nil {
		t.Fatal(err)
	}
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, natstest.Connect(t, url, ropts...)), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.EnsureConfig(context.Background(), protocol.TypeConfig{Shards: 4}); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		user string
		args []string
		want []string
	}{
		{"publisher", []string{"status"}, []string{
			`permission denied: the NATS server refused to let this user publish to "$JS.API.`,
			`shardctl status needs the admin role for type "kv"`,
			`the user "publisher" of ` + creds("publisher") + ` has the publisher role: use admin credentials (shardctl auth user admin <name> --types kv)`,
		}},
		{"region", []string{"move", "1", "r1"}, []string{
			`refused to let this user publish to "$SHARD.kv.admin.move": shardctl move needs the admin role`,
			`has the region role: use admin credentials`,
		}},
		// (The region role may ask the status, for shardd's shard map;
		// no verb that changes anything.)
		{"region", []string{"rebalance", "--dry-run"}, []string{`publish to "$SHARD.kv.admin.rebalance": shardctl rebalance needs the admin role`}},
		{"admin-other", []string{"shards"}, []string{`has the admin role, but not for type "kv"`, "shardctl auth user admin <name> --types kv"}},
	} {
		_, _, err := ctl(t, url, append([]string{"--creds", creds(tc.user)}, tc.args...)...)
		if exitCode(err) != 1 {
			t.Errorf("%s %v: %v, want exit status 1", tc.user, tc.args, err)
			continue
		}
		for _, want := range tc.want {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s %v: %v\nwant %q", tc.user, tc.args, err, want)
			}
		}
	}
	// The admin may: the view comes from KV, no coordinator running. So
	// may the region role (shardd's shard map asks the status).
	for _, user := range []string{"admin", "region"} {
		if out, _, err := ctl(t, url, "--creds", creds(user), "status"); err != nil || !strings.Contains(out, "no coordinator answered") {
			t.Errorf("%s status: %q %v", user, out, err)
		}
	}
}
