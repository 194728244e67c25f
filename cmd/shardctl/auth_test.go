package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
