package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// sh runs shardctl without a server: help, completion, version.
func sh(args ...string) (string, string, error) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

// TestHelpTranscript checks the help of shardctl and of the commands
// that operators change things with against testdata/help.golden.
func TestHelpTranscript(t *testing.T) {
	tr := &transcript{t: t, golden: map[string]*bytes.Buffer{}}
	defer tr.check()
	for _, args := range [][]string{
		{"--help"},
		{"help", "move"},
		{"help", "drain"},
		{"help", "undrain"},
		{"help", "rebalance"},
		{"help", "watch"},
		{"help", "completion"},
		{"help", "auth"},
		{"help", "help"},
		{"help", "mvoe"},
		{"frobnicate"},
	} {
		out, _, err := sh(args...)
		tr.recordAs("help", args, out, err)
	}
}

// TestHelp: every command has help with an example, on stdout, the same
// through help <command> and <command> --help, and exit status 0.
func TestHelp(t *testing.T) {
	top, stderr, err := sh("help")
	if err != nil || stderr != "" {
		t.Fatalf("help: %v %q", err, stderr)
	}
	for _, alias := range [][]string{{"--help"}, {"-h"}} {
		if out, _, err := sh(alias...); err != nil || out != top {
			t.Errorf("%v is not shardctl help: %v", alias, err)
		}
	}
	for _, g := range groups {
		if !strings.Contains(top, "\n"+g+":\n") {
			t.Errorf("help lacks the group %q", g)
		}
	}
	for _, c := range commands {
		if !strings.Contains(top, "\n  "+c.name+" ") {
			t.Errorf("help does not list %s", c.name)
		}
		out, stderr, err := sh("help", c.name)
		if err != nil || stderr != "" || !strings.Contains(out, "Examples:\n  ") || !strings.Contains(out, "shardctl "+c.name) {
			t.Errorf("help %s: %v %q\n%s", c.name, err, stderr, out)
		}
		via, stderr, err := sh(c.name, "--help")
		if err != nil || stderr != "" || via != out {
			t.Errorf("%s --help differs from help %s (%v %q):\n%s", c.name, c.name, err, stderr, via)
		}
		// After the command's arguments too.
		if c.nargs > 0 {
			args := append([]string{c.name}, make([]string, c.nargs)...)
			for i := 1; i <= c.nargs; i++ {
				args[i] = "1"
			}
			if via, _, err := sh(append(args, "--help")...); err != nil || via != out {
				t.Errorf("%v --help differs from help %s: %v", args, c.name, err)
			}
		}
	}
	// bench's own flags, from bench.go, follow its examples.
	if out, _, err := sh("bench", "--help"); err != nil || !strings.Contains(out, "Examples:") || !strings.Contains(out, "-regions") {
		t.Errorf("bench --help: %v\n%s", err, out)
	}
	// No command: the help on stderr, and a usage error.
	out, stderr, err := sh()
	if exitCode(err) != 2 || out != "" || !strings.Contains(stderr, "Usage:") {
		t.Errorf("no command: exit %d, stdout %q", exitCode(err), out)
	}
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"status", "--version"}} {
		out, _, err := sh(args...)
		if err != nil || !strings.HasPrefix(out, "shardctl ") || !strings.Contains(out, "revision") || strings.Count(out, "\n") != 1 {
			t.Errorf("%v: %q %v", args, out, err)
		}
	}
}

func TestCompletionArguments(t *testing.T) {
	for _, args := range [][]string{{"completion"}, {"completion", "tcsh"}, {"completion", "bash", "zsh"}} {
		if _, _, err := sh(args...); exitCode(err) != 2 {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}

// TestCompletionBash checks the bash script's syntax (bash -n) and that it
// completes: commands, their flags, help topics, shells, auth roles,
// files after --creds.
func TestCompletionBash(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Fatal("bash is required for this test (it checks the bash completion script): ", err)
	}
	script := completionScript(t, "bash")
	if out, err := exec.Command(bash, "-n", script).CombinedOutput(); err != nil {
		t.Fatalf("bash -n: %v\n%s", err, out)
	}
	dir := t.TempDir()
	creds := filepath.Join(dir, "admin.creds")
	if err := os.WriteFile(creds, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		line string // the words typed so far; the last one is completed
		want string // COMPREPLY, space-separated
	}{
		{"shardctl mo", "move"},
		{"shardctl un", "undrain unpin"},
		{"shardctl --type kv dr", "drain"},
		{"shardctl move 17 b --wa", "--wait"},
		{"shardctl rebalance --d", "--dry-run --data-prefix"},
		{"shardctl status --wa", ""},
		{"shardctl help reb", "rebalance"},
		{"shardctl completion ", "bash zsh fish"},
		{"shardctl auth ", "init user"},
		{"shardctl auth user ", "publisher region admin"},
		{"shardctl --creds " + dir + "/ad", creds},
		{"shardctl --creds=" + dir + "/ad", creds},
		{"shardctl --nats nats://n1:4222 --timeout=2s mo", "move"},
		{"shardctl --nats=nats://n1:4222 move 1 b --w", "--wait"},
		{"shardctl --nats nats://n1:4222 ", "status regions region shards shard locate stats watch daemon send request move drain undrain pin unpin rebalance scale reshard auth bench completion help"},
		{"shardctl --timeout 1", ""},
		{"shardctl bench --handoff-e", "--handoff-entities"},
	} {
		// COMP_WORDS as bash splits the line: at white space, and at
		// '=' and ':', which are words of their own.
		var quoted []string
		for _, w := range regexp.MustCompile(`[^ =:]+|[=:]`).FindAllString(tc.line, -1) {
			quoted = append(quoted, "'"+w+"'")
		}
		if strings.HasSuffix(tc.line, " ") {
			quoted = append(quoted, "''")
		}
		prog := "source " + script + "\nCOMP_LINE='" + tc.line + "'\nCOMP_POINT=" + strconv.Itoa(len(tc.line)) +
			"\nCOMP_WORDS=(" + strings.Join(quoted, " ") + ")\nCOMP_CWORD=" + strconv.Itoa(len(quoted)-1) + "\n_shardctl\necho \"${COMPREPLY[*]}\"\n"
		out, err := exec.Command(bash, "-c", prog).CombinedOutput()
		if err != nil {
			t.Fatalf("%q: %v\n%s", tc.line, err, out)
		}
		if got := strings.TrimSpace(string(out)); got != tc.want {
			t.Errorf("%q completes to %q, want %q", tc.line, got, tc.want)
		}
	}
}

// TestCompletionZshFish checks the zsh and fish scripts' syntax where
// those shells are installed.
func TestCompletionZshFish(t *testing.T) {
	for _, shell := range []string{"zsh", "fish"} {
		t.Run(shell, func(t *testing.T) {
			path, err := exec.LookPath(shell)
			if err != nil {
				t.Skipf("%s is not installed, so its completion script's syntax is not checked (apt-get install %s checks it)", shell, shell)
			}
			script := completionScript(t, shell)
			if out, err := exec.Command(path, "-n", script).CombinedOutput(); err != nil {
				t.Fatalf("%s -n: %v\n%s", shell, err, out)
			}
			if shell == "fish" {
				// Load it, and ask fish what it completes.
				out, err := exec.Command(path, "--no-config", "-c", "source "+script+"; complete -C 'shardctl un'").CombinedOutput()
				if err != nil || !strings.Contains(string(out), "undrain\t") || !strings.Contains(string(out), "unpin\t") {
					t.Fatalf("fish completes 'shardctl un' to:\n%s %v", out, err)
				}
			}
		})
	}
}

func completionScript(t *testing.T, shell string) string {
	t.Helper()
	out, _, err := sh("completion", shell)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "shardctl."+shell)
	if err := os.WriteFile(path, []byte(out), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
