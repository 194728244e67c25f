package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// system is one region and one coordinator of type kv on a real server.
type system struct {
	url       string
	stopCoord context.CancelFunc
	coordDone chan struct{}
}

func startSystem(t *testing.T, shards int) *system {
	t.Helper()
	srv := natstest.RunServer(t)
	url := natstest.URL(srv)
	nc := natstest.Connect(t, url)
	js := natstest.JetStream(t, nc)
	ctx := context.Background()
	store, err := kvstate.Open(ctx, js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.EnsureConfig(ctx, protocol.TypeConfig{Shards: shards}); err != nil {
		t.Fatal(err)
	}
	subjects := protocol.MustSubjects("", "", "kv")
	buffer, err := kvstate.OpenBuffer(ctx, js, subjects, kvstate.BufferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	agent, err := region.Open(ctx, region.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, ID: "r1", Factory: entities.KV(store)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Close(context.Background()) })
	cctx, cancel := context.WithCancel(ctx)
	s := &system{url: url, stopCoord: cancel, coordDone: make(chan struct{})}
	go func() {
		defer close(s.coordDone)
		coordinator.New(coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "r1"}).Run(cctx)
	}()
	t.Cleanup(func() { cancel(); <-s.coordDone })
	// Wait until every shard is active.
	deadline := time.Now().Add(20 * time.Second)
	for {
		out, _, err := ctl(t, s.url, "shards", "--json")
		if err == nil {
			var rows []protocol.ShardView
			_ = json.Unmarshal([]byte(out), &rows)
			active := 0
			for _, r := range rows {
				if r.State == "active" {
					active++
				}
			}
			if active == shards {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("shards never all active: %s %v", out, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func ctl(t *testing.T, url string, args ...string) (string, string, error) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), append([]string{"--nats", url, "--timeout", "2s"}, args...), func(string) string { return "" }, strings.NewReader("from-stdin"), &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

func TestCommands(t *testing.T) {
	s := startSystem(t, 16)

	out, _, err := ctl(t, s.url, "status", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var st statusJSON
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatal(err)
	}
	if st.Coordinator.Region != "r1" || st.Coordinator.Epoch == 0 || !st.CoordinatorAnswered || st.Active != 16 || st.Unowned != 0 || st.Regions != 1 {
		t.Fatalf("status: %+v", st)
	}

	out, _, err = ctl(t, s.url, "regions", "--json")
	var regions []protocol.RegionView
	if err != nil || json.Unmarshal([]byte(out), &regions) != nil || len(regions) != 1 || regions[0].ID != "r1" || regions[0].Shards != 16 {
		t.Fatalf("regions: %s %v", out, err)
	}

	out, _, err = ctl(t, s.url, "locate", "order-42", "--json")
	var loc location
	if err != nil || json.Unmarshal([]byte(out), &loc) != nil || loc.Shard != protocol.ShardOf("order-42", 16) || loc.Region != "r1" || loc.Subject != "shard.kv.4.order-42" {
		t.Fatalf("locate: %s %v", out, err)
	}

	if out, _, err = ctl(t, s.url, "request", "order-42", `{"op":"set","key":"a","value":"x"}`); err != nil || strings.TrimSpace(out) != `{"ok":true,"value":"x"}` {
		t.Fatalf("request set: %q %v", out, err)
	}
	if _, _, err = ctl(t, s.url, "send", "order-42", `{"op":"append","key":"a","value":"y"}`); err != nil {
		t.Fatalf("send: %v", err)
	}
	if out, _, err = ctl(t, s.url, "request", "order-42", `{"op":"get","key":"a"}`); err != nil || strings.TrimSpace(out) != `{"ok":true,"value":"xy"}` {
		t.Fatalf("request get after send: %q %v", out, err)
	}
	// A payload of "-" is read from standard input.
	if out, _, err = ctl(t, s.url, "request", "echo-me", "-"); err == nil || !strings.Contains(out, `"ok":false`) {
		t.Fatalf("kv entity should refuse a non-JSON payload read from stdin: %q %v", out, err)
	}
	// An entity error is printed and exits non-zero.
	out, _, err = ctl(t, s.url, "request", "order-42", `{"op":"fly"}`)
	if err == nil || !strings.Contains(err.Error(), "entity answered with an error") || !strings.Contains(out, `"ok":false`) {
		t.Fatalf("bad op: %q %v", out, err)
	}

	// Tables for people.
	out, _, err = ctl(t, s.url, "shards")
	if err != nil || !strings.HasPrefix(out, "SHARD  REGION  STATE   FROM\n0      r1      active  -\n") {
		t.Fatalf("shards table:\n%s %v", out, err)
	}
	out, _, err = ctl(t, s.url, "status")
	if err != nil || !strings.Contains(out, "shards:      16 allocated (16 active), 0 unowned") {
		t.Fatalf("status text:\n%s %v", out, err)
	}

	// Moves and drains go to the coordinator, which checks them.
	if out, _, err = ctl(t, s.url, "move", "3", "r1"); err != nil || !strings.Contains(out, "moving shard 3 to r1") {
		t.Fatalf("move to the current owner: %q %v", out, err)
	}
	if _, _, err = ctl(t, s.url, "move", "3", "nowhere"); err == nil || !strings.Contains(err.Error(), "move refused") || !strings.Contains(err.Error(), "no such live region") {
		t.Fatalf("move to an unknown region: %v", err)
	}
	if _, _, err = ctl(t, s.url, "drain", "nowhere"); err == nil || !strings.Contains(err.Error(), "drain refused") {
		t.Fatalf("drain of an unknown region: %v", err)
	}

	// With no coordinator, status still prints what KV knows, and says so.
	s.stopCoord()
	<-s.coordDone
	out, _, err = ctl(t, s.url, "status")
	if err != nil || !strings.Contains(out, "no coordinator answered") || !strings.Contains(out, "16 allocated") {
		t.Fatalf("status without coordinator:\n%s %v", out, err)
	}
}

func TestErrors(t *testing.T) {
	s := startSystem(t, 4)
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
	} {
		_, _, err := ctl(t, s.url, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || errors.Is(err, errUsage) != tc.usage {
			t.Errorf("%v: err %v, want %q (usage error: %v)", tc.args, err, tc.want, tc.usage)
		}
	}
	_, _, err := ctl(t, "nats://127.0.0.1:1", "status")
	if err == nil || !strings.Contains(err.Error(), "cannot connect to NATS at nats://127.0.0.1:1") {
		t.Fatalf("no NATS: %v", err)
	}
}
