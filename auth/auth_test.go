package auth_test

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

func TestInitWritesKeysAndRefusesToOverwrite(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a")
	st, err := auth.Init(dir, auth.Scope{Types: []string{"kv", "orders"}})
	if err != nil {
		t.Fatal(err)
	}
	for name, mode := range map[string]os.FileMode{
		"operator.nk": 0o600, "account.nk": 0o600, "publisher.creds": 0o600, "region.creds": 0o600, "admin.creds": 0o600,
		"operator.jwt": 0o644, "account.jwt": 0o644, "sys.jwt": 0o644, "server.conf": 0o644, "scope.json": 0o644,
	} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode().Perm(), mode)
		}
	}
	ac, err := jwt.DecodeAccountClaims(st.AccountJWT)
	if err != nil {
		t.Fatal(err)
	}
	if !ac.Limits.IsJSEnabled() {
		t.Errorf("account JWT without JetStream: %+v", ac.Limits.JetStreamLimits)
	}
	if _, err := auth.Init(dir, auth.Scope{Types: []string{"kv"}}); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second init: %v, want ErrExists", err)
	}
	loaded, err := auth.Load(dir)
	if err != nil || loaded.Account != st.Account || loaded.System != st.System || !slices.Equal(loaded.Scope.Types, []string{"kv", "orders"}) {
		t.Fatalf("load: %+v %v", loaded, err)
	}

	// auth user: init's scope by default, never overwrites, checks its input.
	path, err := auth.AddUser(dir, auth.Publisher, "web", auth.Scope{})
	if err != nil {
		t.Fatal(err)
	}
	uc := userClaims(t, path)
	if uc.Name != "web" || uc.Issuer != st.Account || !slices.Contains(uc.Pub.Allow, "shard.orders.>") {
		t.Fatalf("user web: %+v", uc)
	}
	if _, err := auth.AddUser(dir, auth.Publisher, "web", auth.Scope{}); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second web: %v, want ErrExists", err)
	}
	if _, err := auth.AddUser(dir, "root", "x", auth.Scope{}); !errors.Is(err, auth.ErrUnknownRole) {
		t.Fatalf("role root: %v", err)
	}
	if _, err := auth.AddUser(dir, auth.Admin, "../x", auth.Scope{}); !errors.Is(err, protocol.ErrInvalidName) {
		t.Fatalf("name ../x: %v", err)
	}
	if _, err := auth.AddUser(t.TempDir(), auth.Admin, "x", auth.Scope{Types: []string{"kv"}}); !errors.Is(err, auth.ErrNotInitialized) {
		t.Fatalf("user in an empty dir: %v", err)
	}
}

// Permissions come from protocol.Subjects: custom prefixes move them,
// and no role of one type reaches another type's subjects.
func TestPermissionsFollowSubjects(t *testing.T) {
	scope := auth.Scope{Types: []string{"a"}, DataPrefix: "app.data", ControlPrefix: "app.ctl"}
	s := protocol.MustSubjects("app.data", "app.ctl", "a")
	p, err := auth.Permissions(auth.Region, "r1", scope)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{s.Region("*"), s.BufferAll(), s.Events(), "$KV.natshard_a.>", "$JS.API.STREAM.CREATE.KV_natshard_a", "$JS.API.CONSUMER.MSG.NEXT.natshard_buf_a.*",
		s.Admin(protocol.AdminStatus), s.Query("*")} { // the last two for shardd's web UI
		if !slices.Contains(p.Pub.Allow, want) {
			t.Errorf("region may not publish %s: %v", want, p.Pub.Allow)
		}
	}
	for _, want := range []string{s.AllData(), s.AdminAll(), s.Query("*"), "_INBOX_natshard.r1.>", s.Events()} {
		if !slices.Contains(p.Sub.Allow, want) {
			t.Errorf("region may not subscribe %s: %v", want, p.Sub.Allow)
		}
	}
	if p.Resp == nil {
		t.Error("region may not answer requests")
	}
	for _, role := range auth.Roles {
		p, err := auth.Permissions(role, "u", scope)
		if err != nil {
			t.Fatal(err)
		}
		for _, subj := range append(p.Pub.Allow, p.Sub.Allow...) {
			if role == auth.Region && strings.HasPrefix(subj, "$JS.API.STREAM.UPDATE.natshard_msgs_a~") {
				continue // a split adds its children's subjects to the type's message streams
			}
			for _, other := range []string{"shard.", "$SHARD.", "natshard_b", "$JS.API.STREAM.DELETE", "$JS.API.STREAM.UPDATE", ">"} {
				if strings.HasPrefix(subj, other) || subj == ">" {
					t.Errorf("%s may use %s", role, subj)
				}
			}
		}
		if len(p.Pub.Deny) > 0 || len(p.Sub.Deny) > 0 {
			t.Errorf("%s: deny lists are not needed with allow lists: %+v", role, p)
		}
	}
	pub, _ := auth.Permissions(auth.Publisher, "u", scope)
	if !slices.Equal(pub.Pub.Allow, []string{"app.data.a.>"}) || !slices.Equal(pub.Sub.Allow, []string{"_INBOX.>"}) {
		t.Errorf("publisher: %+v", pub)
	}
	if _, err := auth.Permissions(auth.Admin, "u", auth.Scope{}); err == nil {
		t.Error("a scope without types was accepted")
	}
}

// A server configured by ConfigureServer admits users of the setup only,
// and Client.Options gives region and admin users their private inbox.
func TestServerInOperatorMode(t *testing.T) {
	dir := t.TempDir()
	st, err := auth.Init(dir, auth.Scope{Types: []string{"kv"}})
	if err != nil {
		t.Fatal(err)
	}
	opts := natstest.DefaultOptions(t)
	if err := st.ConfigureServer(opts); err != nil {
		t.Fatal(err)
	}
	url := natstest.URL(natstest.RunServerWithOptions(t, opts))
	if nc, err := nats.Connect(url); err == nil {
		nc.Close()
		t.Fatal("anonymous client admitted")
	}
	copts, err := auth.Client{Creds: filepath.Join(dir, "admin.creds")}.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc := natstest.Connect(t, url, copts...)
	if in := nc.NewInbox(); !strings.HasPrefix(in, "_INBOX_natshard.admin.") {
		t.Errorf("admin inbox %s", in)
	}
	// The admin's requests get their answers in its private inbox (here:
	// no responders, with no coordinator running).
	if _, err := nc.Request(protocol.MustSubjects("", "", "kv").Admin(protocol.AdminStatus), nil, 5*time.Second); !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("admin request: %v, want no responders", err)
	}
	copts, _ = auth.Client{Creds: filepath.Join(dir, "publisher.creds")}.Options()
	if in := natstest.Connect(t, url, copts...).NewInbox(); !strings.HasPrefix(in, "_INBOX.") {
		t.Errorf("publisher inbox %s", in)
	}
	// Someone else's operator is not trusted.
	other, err := auth.Init(t.TempDir(), auth.Scope{Types: []string{"kv"}})
	if err != nil {
		t.Fatal(err)
	}
	copts, _ = auth.Client{Creds: filepath.Join(other.Dir, "admin.creds")}.Options()
	if nc, err := nats.Connect(url, copts...); err == nil {
		nc.Close()
		t.Fatal("a user of another operator was admitted")
	}
}

// The printed configuration is one nats-server accepts, in operator mode.
func TestServerConfigParses(t *testing.T) {
	dir := t.TempDir()
	st, err := auth.Init(dir, auth.Scope{Types: []string{"kv"}})
	if err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(filepath.Join(dir, auth.FileServerConf))
	if err != nil {
		t.Fatal(err)
	}
	if len(opts.TrustedOperators) != 1 || opts.SystemAccount != st.System || opts.AccountResolver == nil || !opts.JetStream {
		t.Fatalf("options: operators %d, system %q, resolver %v, jetstream %v", len(opts.TrustedOperators), opts.SystemAccount, opts.AccountResolver, opts.JetStream)
	}
	// The preloaded accounts reach the server: a user connects and uses
	// JetStream.
	opts.Host, opts.Port, opts.StoreDir, opts.NoLog, opts.NoSigs = "127.0.0.1", -1, t.TempDir(), true, true
	url := natstest.URL(natstest.RunServerWithOptions(t, opts))
	copts, err := auth.Client{Creds: filepath.Join(dir, "region.creds")}.Options()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kvstate.Open(t.Context(), natstest.JetStream(t, natstest.Connect(t, url, copts...)), "kv", kvstate.Options{}); err != nil {
		t.Fatalf("region user on a server configured by server.conf: %v", err)
	}
}

func TestClientValidate(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.creds")
	os.WriteFile(bad, []byte("not creds"), 0o600)
	for _, c := range []auth.Client{
		{TLSCert: "x"},
		{Creds: filepath.Join(dir, "missing.creds")},
		{Creds: bad},
		{TLSCA: filepath.Join(dir, "missing.pem")},
	} {
		if _, err := c.Options(); err == nil {
			t.Errorf("%+v: accepted", c)
		}
	}
}

func userClaims(t *testing.T, path string) *jwt.UserClaims {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	token, err := jwt.ParseDecoratedJWT(data)
	if err != nil {
		t.Fatal(err)
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		t.Fatal(err)
	}
	return uc
}

// TestUser: the name and role of a credentials file's user, as AddUser
// made it; a file that is not credentials is an error naming it.
func TestUser(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a")
	if _, err := auth.Init(dir, auth.Scope{Types: []string{"kv"}}); err != nil {
		t.Fatal(err)
	}
	path, err := auth.AddUser(dir, auth.Publisher, "web", auth.Scope{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		name string
		role auth.Role
	}{
		{filepath.Join(dir, "admin.creds"), "admin", auth.Admin},
		{filepath.Join(dir, "region.creds"), "region", auth.Region},
		{path, "web", auth.Publisher},
	} {
		if name, role, err := auth.User(tc.path); err != nil || name != tc.name || role != tc.role {
			t.Errorf("User(%s) = %q %q %v, want %q %q", tc.path, name, role, err, tc.name, tc.role)
		}
	}
	if _, _, err := auth.User(filepath.Join(dir, "scope.json")); err == nil || !strings.Contains(err.Error(), "scope.json") {
		t.Errorf("User of a file that is not credentials: %v", err)
	}
}

// TestRegionUserTooLarge: a region user whose JWT could not travel in a
// CONNECT line (max_control_line) is refused when it is made, naming the
// cause, and nothing is written; a few types fit.
func TestRegionUserTooLarge(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a")
	if _, err := auth.Init(dir, auth.Scope{Types: []string{"kv"}}); err != nil {
		t.Fatal(err)
	}
	types := func(n int) auth.Scope {
		var s auth.Scope
		for i := range n {
			s.Types = append(s.Types, fmt.Sprintf("type%d", i))
		}
		return s
	}
	if _, err := auth.AddUser(dir, auth.Region, "few", types(4)); err != nil {
		t.Fatalf("a region user of 4 types: %v", err)
	}
	_, err := auth.AddUser(dir, auth.Region, "many", types(12))
	if err == nil || !strings.Contains(err.Error(), "max_control_line") {
		t.Fatalf("a region user of 12 types: %v, want a refusal naming max_control_line", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "many.creds")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("credentials written for the refused user: %v", err)
	}
}

// TestInitRefusesTooLargeScope: a setup whose region user could not
// connect (its JWT past max_control_line) is refused before any key or
// file is written, so the directory can be used again.
func TestInitRefusesTooLargeScope(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a")
	var scope auth.Scope
	for i := range 12 {
		scope.Types = append(scope.Types, fmt.Sprintf("type%d", i))
	}
	if _, err := auth.Init(dir, scope); err == nil || !strings.Contains(err.Error(), "max_control_line") {
		t.Fatalf("Init of 12 types: %v, want a refusal naming max_control_line", err)
	}
	if files, _ := os.ReadDir(dir); len(files) != 0 {
		t.Errorf("a refused Init wrote %d files", len(files))
	}
	scope.Types = scope.Types[:2]
	if _, err := auth.Init(dir, scope); err != nil {
		t.Errorf("Init of 2 types in the same directory after the refusal: %v", err)
	}
}
