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
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden with the output of this run")

// system is a type kv on a real in-process NATS server: regions (each
// with its own connection, entities of kind kv) and a coordinator that
// waits for all of them before it allocates, and rebalances only when
// asked (so that every shard's place is known: region i of n gets the
// shards i, i+n, ...).
type system struct {
	srv       *server.Server
	url       string
	store     *kvstate.Store
	shards    int
	regions   []string
	stopCoord func()
}

func startSystem(t *testing.T, shards int, regions ...string) *system {
	t.Helper()
	srv := natstest.RunServer(t)
	url := natstest.URL(srv)
	s := &system{srv: srv, url: url, shards: shards, regions: regions}
	for _, id := range regions {
		s.startNode(t, natshard.Options{Region: id, NoCoordinator: true})
	}
	store, err := kvstate.Bind(context.Background(), natstest.JetStream(t, natstest.Connect(t, url)), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s.store = store
	s.stopCoord = s.startCoordinator(t)
	s.waitTable(t, "every shard active", func(st protocol.Status) bool {
		for _, r := range st.Table {
			if r.State != "active" || r.Region != regions[r.Shard%len(regions)] {
				return false
			}
		}
		return len(st.Table) == shards
	})
	for _, id := range regions {
		s.waitLive(t, id)
	}
	return s
}

// startNode starts a natshard node of type kv (entities of kind kv) on a
// connection of its own, that allocates once every region registered and
// rebalances only when asked; it closes at cleanup.
func (s *system) startNode(t *testing.T, opts natshard.Options) *natshard.Node {
	t.Helper()
	opts.Conn, opts.Logger = natstest.Connect(t, s.url), slog.New(slog.DiscardHandler)
	n, err := natshard.Start(context.Background(), opts, natshard.Type{
		Name: "kv", Entity: entities.KV(nil), Shards: s.shards, MinRegions: len(s.regions), RebalanceInterval: natshard.Off,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	return n
}

// startCoordinator starts the coordinator candidate, a node of its own
// that hosts no region (named as the first region); the returned function
// stops it (also at cleanup).
func (s *system) startCoordinator(t *testing.T) (stop func()) {
	t.Helper()
	n := s.startNode(t, natshard.Options{Region: s.regions[0], NoRegion: true})
	return func() { _ = n.Close(context.Background()) }
}

// waitLive waits until region id serves every shard it holds live (the
// table says active once the end marker is written; the region goes live
// when its replay reaches it).
func (s *system) waitLive(t *testing.T, id string) {
	t.Helper()
	nc := natstest.Connect(t, s.url)
	defer nc.Close()
	natstest.Eventually(t, 20*time.Second, "region "+id+" to serve its shards live", func() error {
		var ans protocol.QueryAnswer
		m, err := nc.Request(protocol.MustSubjects("", "", "kv").Query(id), nil, 2*time.Second)
		if err == nil {
			err = json.Unmarshal(m.Data, &ans)
		}
		if err == nil && slices.ContainsFunc(ans.Shards, func(r protocol.ShardReport) bool { return r.Mode != "live" }) {
			err = fmt.Errorf("%+v", ans)
		}
		return err
	})
}

// waitTable polls the coordinator's status until cond holds.
func (s *system) waitTable(t *testing.T, what string, cond func(protocol.Status) bool) {
	t.Helper()
	natstest.Eventually(t, 20*time.Second, what, func() bool {
		out, _, err := ctl(t, s.url, "status", "--json")
		var st statusJSON
		if err == nil && json.Unmarshal([]byte(out), &st) == nil && st.CoordinatorAnswered {
			full, err := status(s.url)
			return err == nil && cond(full)
		}
		return false
	})
}

func status(url string) (protocol.Status, error) {
	var st protocol.Status
	nc, err := nats.Connect(url)
	if err != nil {
		return st, err
	}
	defer nc.Close()
	m, err := nc.Request(protocol.MustSubjects("", "", "kv").Admin(protocol.AdminStatus), nil, 2*time.Second)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(m.Data, &st)
}

// silentRegion registers a region that obeys probes, so that the
// coordinator keeps it, but answers no query and refuses every other
// command (like a shardd from before queries existed; a shard moved to it
// stays binding). It returns a function that deregisters it.
func (s *system) silentRegion(t *testing.T, id string) (stop func()) {
	stop, _ = s.silentRegionLeaving(t, id)
	return stop
}

// silentRegionLeaving is silentRegion that also returns a function that
// marks it leaving in its registration.
func (s *system) silentRegionLeaving(t *testing.T, id string) (stop, leave func()) {
	t.Helper()
	nc := natstest.Connect(t, s.url)
	info := protocol.RegionInfo{ID: id, Incarnation: "silent-" + id, Started: time.Now().UnixMilli()}
	lease, err := s.store.RegisterRegion(context.Background(), info, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	leave = func() {
		info.Leaving = true
		if lease, err = s.store.Renew(context.Background(), lease, info); err != nil {
			t.Fatal(err)
		}
	}
	sub, err := nc.Subscribe(protocol.MustSubjects("", "", "kv").Region(id), func(m *nats.Msg) {
		var cmd protocol.Command
		reply := protocol.Reply{Incarnation: info.Incarnation}
		if protocol.Decode(m.Data, &cmd) != nil || cmd.Kind != protocol.CmdProbe {
			reply.Error = "this test region only answers probes"
		}
		reply.Epoch = cmd.Epoch
		data, _ := protocol.Encode(reply)
		_ = m.Respond(data)
	})
	if err != nil {
		t.Fatal(err)
	}
	return func() {
		_ = sub.Unsubscribe()
		if err := s.store.Release(context.Background(), lease); err != nil {
			t.Fatal(err)
		}
	}, leave
}

func ctl(t *testing.T, url string, args ...string) (string, string, error) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), append([]string{"--nats", url, "--timeout", "2s"}, args...), func(string) string { return "" }, strings.NewReader("from-stdin"), &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

// transcript collects shardctl sessions, one golden file per command, or
// all in testdata/<file>.golden when file is set.
type transcript struct {
	t      *testing.T
	url    string
	golden map[string]*bytes.Buffer
	file   string
}

// normalise replaces what differs from run to run: incarnations (nuid),
// epochs, message rates (in tables, always the last column), times.
var normalisers = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`\b[A-Za-z0-9]{22}\b`), "INCARNATION"},
	{regexp.MustCompile(`epoch \d+`), "epoch E"},
	{regexp.MustCompile(`("epoch": ?)\d+`), `${1}E`},
	{regexp.MustCompile(`("messages_per_second": ?)[-+.e0-9]+`), `${1}R`},
	{regexp.MustCompile(`(?m)( +)\d+\.\d$`), "${1}R"},
	{regexp.MustCompile(`("time": ?)"[^"]*"`), `${1}"T"`},
	{regexp.MustCompile(`(?m)^\d\d:\d\d:\d\d\.\d\d\d  `), "HH:MM:SS.mmm  "},
}

func normalise(s string) string {
	for _, n := range normalisers {
		s = n.re.ReplaceAllString(s, n.with)
	}
	return s
}

// record writes "$ shardctl args", the output, the error (as shardctl
// prints it) and a non-zero exit status to the command's golden file
// (testdata/<first argument>.golden).
func (tr *transcript) record(args []string, out string, err error) {
	name := args[0]
	if tr.file != "" {
		name = tr.file
	}
	tr.recordAs(name, args, out, err)
}

// recordAs is record into testdata/<name>.golden.
func (tr *transcript) recordAs(name string, args []string, out string, err error) {
	b := tr.golden[name]
	if b == nil {
		b = &bytes.Buffer{}
		tr.golden[name] = b
	}
	fmt.Fprintf(b, "$ shardctl %s\n%s", strings.Join(quote(args), " "), normalise(out))
	if err != nil {
		fmt.Fprintf(b, "%s\n[exit %d]\n", normalise(errorLine(err)), exitCode(err))
	}
	b.WriteString("\n")
}

func (tr *transcript) run(args ...string) string {
	tr.t.Helper()
	out, _, err := ctl(tr.t, tr.url, args...)
	tr.record(args, out, err)
	return out
}

func quote(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = a
		if a == "" || strings.ContainsAny(a, " {}\"*") {
			out[i] = "'" + a + "'"
		}
	}
	return out
}

// check compares every golden file with this run's transcript, or
// rewrites them with -update.
func (tr *transcript) check() {
	tr.t.Helper()
	for _, name := range slices.Sorted(maps.Keys(tr.golden)) {
		path := filepath.Join("testdata", name+".golden")
		got := tr.golden[name].Bytes()
		if *update {
			if err := os.MkdirAll("testdata", 0o755); err != nil {
				tr.t.Fatal(err)
			}
			if err := os.WriteFile(path, got, 0o644); err != nil {
				tr.t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(path)
		if err != nil {
			tr.t.Fatalf("%v (run go test -update to write it)", err)
		}
		if !bytes.Equal(got, want) {
			tr.t.Errorf("%s differs (go test -update rewrites it):\n--- got\n%s\n--- want\n%s", path, got, want)
		}
	}
}

// startWatch runs shardctl watch with args in the background and returns
// once it is subscribed; wait returns its output and error.
func (tr *transcript) startWatch(args ...string) (wait func()) {
	tr.t.Helper()
	var stdout, stderr natstest.Buffer
	done := make(chan error, 1)
	go func() {
		done <- run(context.Background(), append([]string{"--nats", tr.url, "--timeout", "2s"}, args...), func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
	}()
	natstest.Eventually(tr.t, 10*time.Second, "watch to start", func() error {
		select {
		case err := <-done:
			tr.t.Fatalf("watch %v ended before it began: %v %s", args, err, stderr.String())
		default:
		}
		if !strings.Contains(stderr.String(), "watching") {
			return fmt.Errorf("%q", stderr.String())
		}
		return nil
	})
	return func() {
		tr.t.Helper()
		select {
		case err := <-done:
			tr.record(args, stdout.String(), err)
		case <-time.After(20 * time.Second):
			tr.t.Fatalf("watch %v did not end; it printed:\n%s", args, stdout.String())
		}
	}
}

// TestTranscript is an operator's session against two regions and a
// coordinator, checked against testdata/<command>.golden.
func TestTranscript(t *testing.T) {
	s := startSystem(t, 16, "r1", "r2")
	tr := &transcript{t: t, url: s.url, golden: map[string]*bytes.Buffer{}}
	defer tr.check()

	tr.run("status")
	tr.run("status", "--json")
	tr.run("regions")
	tr.run("regions", "--json")

	// Entities: order-42 and user-1 are in shard 4 (r1), user-7 in 14
	// (r1), order-7 in 11 (r2).
	tr.run("request", "order-42", `{"op":"set","key":"status","value":"paid"}`)
	tr.run("send", "order-42", `{"op":"incr","key":"items","by":3}`)
	tr.run("send", "order-42", `{"op":"incr","key":"items"}`, "--json")
	tr.run("request", "order-42", `{"op":"get"}`)
	tr.run("request", "user-7", `{"op":"set","key":"name","value":"ann"}`)
	tr.run("request", "user-1", `{"op":"set","key":"name","value":"bob"}`)
	tr.run("request", "order-7", `{"op":"append","key":"log","value":"x"}`)
	tr.run("request", "order-7", `{"op":"fly"}`) // an entity's error: exit 1
	tr.run("request", "order-7", "-")            // the payload from stdin, not JSON
	tr.run("locate", "order-42")
	tr.run("locate", "order-7", "--json")

	tr.run("shards")
	tr.run("shard", "4")
	tr.run("shard", "4", "--json")
	tr.run("shard", "4", "--limit", "1")
	tr.run("shard", "5")
	tr.run("region", "r1")
	tr.run("region", "r2", "--json")
	tr.run("region", "nowhere")
	tr.run("stats")
	tr.run("stats", "--json")

	// A region that answers no queries is reported, not fatal.
	stop := s.silentRegion(t, "r3")
	s.waitTable(t, "r3 registered", func(st protocol.Status) bool { return len(st.Regions) == 3 })
	tr.run("stats")
	tr.run("region", "r3")
	tr.run("region", "r3", "--json")
	stop()
	s.waitTable(t, "r3 gone", func(st protocol.Status) bool { return len(st.Regions) == 2 })

	// Watch a move as it happens (shard 2 is on r1).
	waitTable := s.watchAndMove(tr, 2, "r2")
	waitTable()
	tr.run("move", "2", "r2")
	tr.run("move", "2", "nowhere")
	tr.run("shards", "--json")

	// Pin shard 5 (on r2) to r1; the next round moves it.
	tr.run("pin", "5", "r1")
	tr.run("pin", "7", "r9", "--json")
	tr.run("shards")
	tr.run("rebalance", "--dry-run")
	tr.run("rebalance", "--dry-run", "--json")
	tr.run("rebalance")
	s.waitTable(t, "shard 5 on r1", func(st protocol.Status) bool { return st.Table[5].Region == "r1" && st.Table[5].State == "active" })
	s.waitLive(t, "r1")
	tr.run("shard", "5")
	tr.run("move", "5", "r2")
	tr.run("unpin", "5")
	tr.run("unpin", "7", "--json")
	tr.run("unpin", "7")
	tr.run("rebalance", "--dry-run")
	tr.run("rebalance", "--json")

	// Drain r2, waiting until everything is on r1 (progress goes to
	// stderr, the result to stdout).
	tr.run("undrain", "r2")
	tr.run("drain", "r2", "--wait", "--timeout", "30s")
	s.waitTable(t, "r2 drained", func(st protocol.Status) bool {
		for _, r := range st.Table {
			if r.Region != "r1" || r.State != "active" {
				return false
			}
		}
		return true
	})
	tr.run("regions")
	tr.run("stats")

	// Undrain it, and move shards back to it.
	s.waitLive(t, "r1")
	tr.run("undrain", "r2", "--wait", "--timeout", "30s")
	tr.run("undrain", "r2", "--json")
	tr.run("undrain", "nowhere")
	tr.run("regions")
	tr.run("rebalance", "--wait", "--timeout", "30s")
	s.waitLive(t, "r2")
	tr.run("move", "6", "r2", "--wait", "--timeout", "30s")
	tr.run("move", "6", "r1", "--wait", "--timeout", "30s", "--json")
	s.waitLive(t, "r1")

	// Without a coordinator, the views come from KV and say so.
	s.stopCoord()
	tr.run("status")
	tr.run("shard", "5")
	tr.run("move", "1", "r1")
}

// watchAndMove runs watch (a table and JSON) while shard moves to
// target, and returns when both watchers saw its three steps.
func (s *system) watchAndMove(tr *transcript, shard int, target string) (wait func()) {
	waitTable := tr.startWatch("watch", "--count", "3")
	waitJSON := tr.startWatch("watch", "--count", "3", "--json")
	tr.run("move", fmt.Sprint(shard), target)
	return func() {
		waitTable()
		waitJSON()
		s.waitTable(tr.t, "the move done", func(st protocol.Status) bool {
			return st.Table[shard].Region == target && st.Table[shard].State == "active"
		})
		s.waitLive(tr.t, target)
	}
}

// TestChangeDuringHandover: a change asked for while no coordinator runs
// waits for the next one, within --timeout.
func TestChangeDuringHandover(t *testing.T) {
	s := startSystem(t, 4, "r1")
	s.stopCoord()
	done := make(chan error, 1)
	var out bytes.Buffer
	go func() {
		done <- run(context.Background(), []string{"--nats", s.url, "--timeout", "20s", "pin", "1", "r1"}, func(string) string { return "" }, strings.NewReader(""), &out, io.Discard)
	}()
	// It asks again and again: its connection sent 10 messages (binding
	// the type takes 5), and it runs still.
	natstest.Eventually(t, 20*time.Second, "pin to ask the coordinator 5 times", func() error {
		select {
		case err := <-done:
			t.Fatalf("pin without a coordinator ended at once: %v", err)
		default:
		}
		cz, err := s.srv.Connz(&server.ConnzOptions{})
		if err != nil {
			return err
		}
		for _, c := range cz.Conns {
			if c.Name == "shardctl" && c.InMsgs >= 10 {
				return nil
			}
		}
		return errors.New("not yet")
	})
	s.startCoordinator(t)
	select {
	case err := <-done:
		if err != nil || !strings.Contains(out.String(), "pinned shard 1 to r1") {
			t.Fatalf("pin once a coordinator runs: %q %v", out.String(), err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("pin never ended")
	}
	if pins, err := s.store.Pins(context.Background()); err != nil || pins[1] != "r1" {
		t.Fatalf("pins %v %v", pins, err)
	}
}

func TestErrors(t *testing.T) {
	s := startSystem(t, 4, "r1")
	for _, tc := range []struct {
		args  []string
		usage bool
		want  string
	}{
		{[]string{}, true, "no command given"},
		{[]string{"frobnicate"}, true, "unknown command"},
		{[]string{"locate"}, true, "locate takes 1 argument"},
		{[]string{"locate", "a b"}, true, "invalid entity id"},
		{[]string{"request", "x.*", "{}"}, true, "wildcard"},
		{[]string{"--type", "nope", "status"}, false, `unknown type "nope"`},
		{[]string{"--type", "bad type", "status"}, true, "invalid name"},
		{[]string{"--timeout", "0s", "status"}, true, "--timeout"},
		{[]string{"move", "x", "r1"}, true, "not a number"},
		{[]string{"move", "4", "r1"}, true, "not a number in 0..3"},
		{[]string{"move", "1", "r 1"}, true, "invalid name"},
		{[]string{"drain"}, true, "drain takes 1 argument"},
		{[]string{"pin", "4", "r1"}, true, "not a number in 0..3"},
		{[]string{"pin", "1", "r.1"}, true, "invalid name"},
		{[]string{"unpin", "-1"}, true, "flag provided but not defined: -1"},
		{[]string{"unpin", "--", "-1"}, true, "not a number"},
		{[]string{"--bogus", "status"}, true, "flag provided but not defined"},
		{[]string{"shard", "9"}, true, "not a number in 0..3"},
		{[]string{"region", "*"}, true, "invalid name"},
		{[]string{"rebalance", "now"}, true, "rebalance takes 0 argument"},
		{[]string{"stats", "--dry-run"}, true, "--dry-run is not a flag of stats"},
		{[]string{"rebalance", "--count", "2"}, true, "--count is not a flag of rebalance"},
		{[]string{"watch", "--count", "-1"}, true, "--count must be 0 or more"},
		{[]string{"region", "r1", "--limit", "0"}, true, "--limit 1..100000"},
		{[]string{"region", "r9"}, false, `no region "r9" is registered (regions: r1)`},
	} {
		_, _, err := ctl(t, s.url, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || errors.Is(err, errUsage) != tc.usage {
			t.Errorf("%v: err %v, want %q (usage error: %v)", tc.args, err, tc.want, tc.usage)
		}
		if want := map[bool]int{true: 2, false: 1}[tc.usage]; exitCode(err) != want {
			t.Errorf("%v: exit %d, want %d", tc.args, exitCode(err), want)
		}
	}
	_, _, err := ctl(t, "nats://127.0.0.1:1", "status")
	if err == nil || !strings.Contains(err.Error(), "cannot connect to NATS at nats://127.0.0.1:1") || exitCode(err) != 1 {
		t.Fatalf("no NATS: %v", err)
	}
	if exitCode(nil) != 0 || exitCode(flag.ErrHelp) != 0 {
		t.Fatal("exit status of success or --help is not 0")
	}
}
