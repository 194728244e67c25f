package coordinator_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// TestPinsThroughTheAdminAPI: a pin asked for over the admin API is
// written to KV before the answer, announced on the events subject, shown
// in the status, and read by the next coordinator. Bad requests get an
// error answer and change nothing.
func TestPinsThroughTheAdminAPI(t *testing.T) {
	nc, store, buffer, subjects := openType(t)
	ctx := context.Background()
	openRegion(t, nc, store, buffer, subjects, "r1", entities.Echo())
	start := func(name string) (stop func()) { return startCoordinator(nc, store, buffer, subjects, name) }
	stop := start("c1")
	natstest.Eventually(t, 20*time.Second, "a coordinator answers", func() error { _, err := status(nc, subjects); return err })

	events, err := nc.SubscribeSync(subjects.Events())
	if err != nil {
		t.Fatal(err)
	}
	admin := func(verb, body string) map[string]any {
		t.Helper()
		m, err := nc.Request(subjects.Admin(verb), []byte(body), 2*time.Second)
		if err != nil {
			t.Fatalf("%s %s: %v", verb, body, err)
		}
		var ans map[string]any
		if err := json.Unmarshal(m.Data, &ans); err != nil {
			t.Fatalf("%s: %q: %v", verb, m.Data, err)
		}
		return ans
	}
	ans := admin(protocol.AdminPin, `{"shard":5,"region":"r2"}`)
	if ans["ok"] != true || !strings.Contains(fmt.Sprint(ans["note"]), "r2 is not registered") {
		t.Fatalf("pin: %v", ans)
	}
	if pins, err := store.Pins(ctx); err != nil || !maps.Equal(pins, map[int]string{5: "r2"}) {
		t.Fatalf("KV after the answer: %v %v", pins, err)
	}
	ev := nextEvent(t, events, protocol.EventPin)
	if ev.Shard == nil || *ev.Shard != 5 || ev.Region != "r2" || ev.Epoch == 0 || ev.Time == "" {
		t.Fatalf("pin event %+v", ev)
	}
	for _, tc := range []struct{ verb, body, want string }{
		{protocol.AdminPin, `{"shard":16,"region":"r1"}`, "out of range"},
		{protocol.AdminPin, `{"shard":1,"region":"r 1"}`, "invalid name"},
		{protocol.AdminPin, `{"shard":1,"region":"r1","extra":1}`, "unknown field"},
		{protocol.AdminPin, ``, "empty body"},
		{protocol.AdminUnpin, `{"shard":-1}`, "out of range"},
		{protocol.AdminRebalance, `{"dry":true}`, "unknown field"},
		{protocol.AdminMove, `{"shard":5,"region":"r1"}`, "pinned to r2"},
		{"frobnicate", `{}`, "unknown admin verb"},
	} {
		if ans := admin(tc.verb, tc.body); !strings.Contains(fmt.Sprint(ans["error"]), tc.want) {
			t.Errorf("%s %s: %v, want an error with %q", tc.verb, tc.body, ans, tc.want)
		}
	}
	if pins, _ := store.Pins(ctx); len(pins) != 1 {
		t.Fatalf("refused requests changed the pins: %v", pins)
	}
	// An empty rebalance body runs a round; one region: nothing to move.
	if ans := admin(protocol.AdminRebalance, ``); ans["dry_run"] != false || len(ans["moves"].([]any)) != 0 {
		t.Fatalf("rebalance: %v", ans)
	}

	stop()
	stop = start("c2")
	defer stop()
	natstest.Eventually(t, 20*time.Second, "the next coordinator shows the pin", func() error {
		st, err := status(nc, subjects)
		if err != nil {
			return err
		}
		if st.Coordinator.Region != "c2" || st.Table[5].Pin != "r2" {
			return fmt.Errorf("coordinator %s, shard 5 %+v", st.Coordinator.Region, st.Table[5])
		}
		return nil
	})
	if ans := admin(protocol.AdminUnpin, `{"shard":5}`); ans["ok"] != true {
		t.Fatalf("unpin: %v", ans)
	}
	if pins, err := store.Pins(ctx); err != nil || len(pins) != 0 {
		t.Fatalf("KV after unpin: %v %v", pins, err)
	}
	nextEvent(t, events, protocol.EventUnpin)
}

// nextEvent returns the next event of kind on sub, skipping others.
func nextEvent(t *testing.T, sub *nats.Subscription, kind string) protocol.Event {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		m, err := sub.NextMsg(time.Until(deadline))
		if err != nil {
			t.Fatalf("no %s event: %v", kind, err)
		}
		var ev protocol.Event
		if err := json.Unmarshal(m.Data, &ev); err != nil {
			t.Fatalf("event %q: %v", m.Data, err)
		}
		if ev.Kind == kind {
			return ev
		}
	}
}

// TestLoadAwareWithRealLoadReports: regions measure their shards' message
// rates and report them in probe answers; a load-aware coordinator moves
// the hottest shard of the busy region to the idle one.
func TestLoadAwareWithRealLoadReports(t *testing.T) {
	nc, store, buffer, subjects := openType(t)
	ctx := context.Background()
	for _, id := range []string{"r1", "r2"} {
		openRegion(t, nc, store, buffer, subjects, id, entities.Echo())
	}
	strategy, _, err := strategies.Parse("load-aware")
	if err != nil {
		t.Fatal(err)
	}
	defer runNode(coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "r1",
		Strategy: strategy, MinRegions: 2, RebalanceInterval: -1})()
	natstest.Eventually(t, 20*time.Second, "shards 0 and 2 on r1", func() error {
		st, err := status(nc, subjects)
		if err != nil {
			return err
		}
		for _, s := range st.Table {
			if s.State != "active" || s.Region != []string{"r1", "r2"}[s.Shard%2] {
				return fmt.Errorf("shard %+v", s)
			}
		}
		return nil
	})

	// Shard 0 gets about 200 messages/s, shard 2 about 100, the others
	// nothing: r1 carries everything.
	idOf := func(shard int) string {
		for i := 0; ; i++ {
			if id := fmt.Sprintf("e%d", i); protocol.ShardOf(id, shards) == shard {
				return id
			}
		}
	}
	hot, warm := subjects.Entity(0, idOf(0)), subjects.Entity(2, idOf(2))
	pctx, stopPublishing := context.WithCancel(ctx)
	defer stopPublishing()
	go func() {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for i := 0; pctx.Err() == nil; i++ {
			<-tick.C
			_ = nc.Publish(hot, []byte("x"))
			if i%2 == 0 {
				_ = nc.Publish(warm, []byte("x"))
			}
		}
	}()
	rebalance := func(dry bool) protocol.RebalanceAnswer {
		t.Helper()
		body, _ := json.Marshal(protocol.RebalanceRequest{DryRun: dry})
		m, err := nc.Request(subjects.Admin(protocol.AdminRebalance), body, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var ans protocol.RebalanceAnswer
		if err := json.Unmarshal(m.Data, &ans); err != nil {
			t.Fatalf("%q: %v", m.Data, err)
		}
		return ans
	}
	want := []protocol.PlannedMove{{Shard: 0, From: "r1", To: "r2"}}
	natstest.Eventually(t, 20*time.Second, "a plan that moves the hot shard", func() error {
		if plan := rebalance(true); !slices.Equal(plan.Moves, want) {
			return fmt.Errorf("plan %+v, want %v", plan.Moves, want)
		}
		return nil
	})
	if plan := rebalance(false); !slices.Equal(plan.Moves, want) {
		t.Fatalf("round %+v, want %v", plan.Moves, want)
	}
	natstest.Eventually(t, 20*time.Second, "shard 0 on r2", func() error {
		st, err := status(nc, subjects)
		if err != nil {
			return err
		}
		if s := st.Table[0]; s.Region != "r2" || s.State != "active" {
			return fmt.Errorf("shard 0 %+v", s)
		}
		return nil
	})
}
