package main

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// evil holds what a forged field may carry to take over a terminal: an
// OSC title change ended by BEL, clear screen, a carriage return, a
// right-to-left override, a C1 CSI, DEL and invalid UTF-8.
const evil = "r1\x1b]0;pwned\x07\x1b[2J\r\u202e\u009b31m\x7f\xff"

// terminalSafe fails the test if s holds what a terminal may act on:
// control characters other than newline, bidirectional controls, invalid
// UTF-8.
func terminalSafe(t *testing.T, what, s string) {
	t.Helper()
	if !utf8.ValidString(s) {
		t.Errorf("%s: invalid UTF-8 in %q", what, s)
	}
	for _, r := range s {
		if (unicode.IsControl(r) && r != '\n') || unicode.Is(unicode.Bidi_Control, r) {
			t.Errorf("%s: %U reaches the terminal:\n%q", what, r, s)
			return
		}
	}
}

func TestEscape(t *testing.T) {
	if got, want := clean(evil), `r1\x1b]0;pwned\x07\x1b[2J\x0d\u202e\x9b31m\x7f\xff`; got != want {
		t.Errorf("clean(evil) = %s, want %s", got, want)
	}
	if got := cleanText("a\tb\nc\x1b"); got != "a\tb\nc\\x1b" {
		t.Errorf("cleanText keeps tabs and newlines only: %q", got)
	}
	for _, s := range []string{"", "plain ascii", "café ✓ 名前"} {
		if clean(s) != s {
			t.Errorf("clean changed %q", s)
		}
	}
	if got := string(jsonSafe([]byte(`{"a":"x` + "\x7f\u009b\u202e\xff" + `y"}`))); got != `{"a":"x\u007f\u009b\u202e\ufffdy"}` {
		t.Errorf("jsonSafe: %s", got)
	}
}

// TestForgedInputIsEscaped: events forged on the events subject, and a
// forged coordinator and region answering the admin API and queries, put
// control characters in every field; no output of shardctl, table or JSON,
// passes them to the terminal.
func TestForgedInputIsEscaped(t *testing.T) {
	s := startSystem(t, 4, "r1")
	tr := &transcript{t: t, url: s.url, golden: map[string]*bytes.Buffer{}, file: "forged"}
	nc := natstest.Connect(t, s.url)
	subjects := protocol.MustSubjects("", "", "kv")

	// Forged events, watched as lines and as JSON.
	zero := 0
	forged := [][]byte{
		mustJSON(t, protocol.Event{Time: evil, Epoch: 1, Kind: protocol.EventShard, Shard: &zero, State: evil, Region: evil, Source: evil}),
		mustJSON(t, protocol.Event{Kind: protocol.EventRegionUp, Region: evil}),
		mustJSON(t, protocol.Event{Kind: evil}),
		[]byte("\x1b[2J not JSON\r"),
		[]byte("{\"kind\":\"pin\",\"region\":\"" + "\u009b2J\x7f\xff" + "\"}\r"),
	}
	n := len(forged)
	waitTable := tr.startWatch("watch", "--count", strconv.Itoa(n))
	waitJSON := tr.startWatch("watch", "--count", strconv.Itoa(n), "--json")
	for _, data := range forged {
		if err := nc.Publish(subjects.Events(), data); err != nil {
			t.Fatal(err)
		}
	}
	waitTable()
	waitJSON()

	// A forged coordinator and region.
	s.stopCoord()
	status := protocol.Status{
		Type: "kv", Shards: 4, Coordinator: protocol.CoordinatorView{Region: evil, Epoch: 9},
		Regions: []protocol.RegionView{{ID: "r9", Incarnation: evil, Version: evil, Leaving: true, Shards: 1}, {ID: evil, Incarnation: evil}},
		Table: []protocol.ShardView{
			{Shard: 0, Region: evil, State: evil, Source: evil, Pin: evil},
			{Shard: 1, Region: "r9", State: "handoff", Source: evil},
			{Shard: 2, Region: "r9", State: "active"},
			{Shard: 3, Region: evil, State: "binding"},
		},
	}
	answer := func(subject string, v any) {
		data := mustJSON(t, v)
		if _, err := nc.Subscribe(subject, func(m *nats.Msg) { _ = m.Respond(data) }); err != nil {
			t.Fatal(err)
		}
	}
	answer(subjects.Admin(protocol.AdminStatus), status)
	answer(subjects.Admin(protocol.AdminMove), protocol.AdminOK{OK: true, Note: evil})
	answer(subjects.Admin(protocol.AdminPin), protocol.AdminError{Error: evil})
	answer(subjects.Admin(protocol.AdminRebalance), protocol.RebalanceAnswer{Moves: []protocol.PlannedMove{{Shard: 2, From: evil, To: evil}}})
	answer(subjects.Query("r9"), protocol.QueryAnswer{Region: evil, Incarnation: evil, Shards: []protocol.ShardReport{
		{Shard: 1, Mode: evil, Entities: 2, EntityIDs: []string{evil, "ok"}},
	}})
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"status"}, {"regions"}, {"shards"}, {"shard", "0"}, {"shard", "1"}, {"region", "r9"}, {"stats"}, {"locate", "x"},
		{"move", "1", "r9"}, {"pin", "2", "r9"}, {"rebalance"},
	} {
		for _, format := range [][]string{nil, {"--json"}} {
			args := append(args, format...)
			out, stderr, err := ctl(t, s.url, args...)
			terminalSafe(t, strings.Join(args, " "), out)
			terminalSafe(t, strings.Join(args, " ")+" (stderr)", stderr)
			if err != nil {
				terminalSafe(t, strings.Join(args, " ")+" (error)", errorLine(err))
			}
			if format != nil && err == nil && !json.Valid([]byte(out)) {
				t.Errorf("%v: not JSON:\n%s", args, out)
			}
			tr.record(args, out, err)
		}
	}
	for name, b := range tr.golden {
		terminalSafe(t, name, b.String())
	}
	tr.check()
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
