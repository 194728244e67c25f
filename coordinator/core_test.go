package coordinator

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// The scenarios below follow DESIGN.md section 6 (membership, allocation)
// and section 7 (coordinator failover never moves a shard with a live owner).

func testConfig(shards int) CoreConfig {
	return CoreConfig{Shards: shards, Strategy: strategies.NewLeastShard(20, 0.1), ProbeEvery: 5, BindRetry: 20}
}

func up(id, inc string, rev uint64) RegionUp {
	return RegionUp{RegionSeen{Info: protocol.RegionInfo{ID: id, Incarnation: inc}, Revision: rev}}
}

// describe renders actions one per line, compactly, for assertions.
func describe(actions []Action) []string {
	var out []string
	for _, a := range actions {
		switch a := a.(type) {
		case WriteShard:
			r := a.Record
			out = append(out, fmt.Sprintf("write %d %s %s/%s e%d", r.Shard, r.State, r.Region, r.Incarnation, r.Epoch))
		case Send:
			out = append(out, fmt.Sprintf("send %s %s/%s e%d %v", a.Command.Kind, a.Region, a.Command.Incarnation, a.Command.Epoch, a.Command.Shards))
		case RemoveRegion:
			out = append(out, fmt.Sprintf("remove %s rev%d", a.ID, a.Revision))
		case StepDown:
			out = append(out, "stepdown")
		}
	}
	return out
}

func count(lines []string, prefix string) int {
	n := 0
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}

// confirm answers every Send in actions with OK (probes report held shards
// as given by holds) and returns the actions that causes.
func confirm(c *Core, actions []Action, holds map[string][]int) []Action {
	var next []Action
	for _, a := range actions {
		if s, ok := a.(Send); ok {
			reply := protocol.Reply{Epoch: c.Epoch(), Incarnation: s.Command.Incarnation}
			if s.Command.Kind == protocol.CmdProbe {
				reply.Held = holds[s.Region]
			}
			next = append(next, c.Step(CommandDone{Send: s, Outcome: OK, Reply: reply})...)
		}
	}
	return next
}

func owners(c *Core) map[string][]int {
	m := map[string][]int{}
	for _, r := range c.Table() {
		if r.Region != "" {
			m[r.Region] = append(m[r.Region], r.Shard)
		}
	}
	return m
}

func assertAllActive(t *testing.T, c *Core) {
	t.Helper()
	for _, r := range c.Table() {
		if r.State != protocol.StateActive || r.Region == "" {
			t.Fatalf("shard %d is %s on %q, want active", r.Shard, r.State, r.Region)
		}
	}
}

func TestJoinAllocatesEveryShardOnce(t *testing.T) {
	c, acts := NewCore(testConfig(8), "r1", 7, nil, nil)
	if len(acts) != 0 {
		t.Fatalf("no regions: want no actions, got %v", describe(acts))
	}
	acts = c.Step(up("r1", "a", 1))
	d := describe(acts)
	if count(d, "write ") != 8 || count(d, "send bind r1/a e7 [0 1 2 3 4 5 6 7]") != 1 {
		t.Fatalf("join: got %v", d)
	}
	// Table writes come before the command that depends on them.
	if !strings.HasPrefix(d[len(d)-1], "send bind") {
		t.Fatalf("bind must follow the writes: %v", d)
	}
	acts = confirm(c, acts, nil)
	if got := count(describe(acts), "write "); got != 8 {
		t.Fatalf("confirmation: want 8 writes to active, got %v", describe(acts))
	}
	assertAllActive(t, c)
}

func TestMinRegionsWaitsThenSpreads(t *testing.T) {
	cfg := testConfig(10)
	cfg.MinRegions = 2
	c, _ := NewCore(cfg, "r1", 1, nil, nil)
	if acts := c.Step(up("r1", "a", 1)); len(acts) != 0 {
		t.Fatalf("one region of two: want nothing, got %v", describe(acts))
	}
	confirm(c, c.Step(up("r2", "b", 2)), nil)
	o := owners(c)
	if len(o["r1"]) != 5 || len(o["r2"]) != 5 {
		t.Fatalf("want 5+5, got %v", o)
	}
	assertAllActive(t, c)
}

func TestCrashDetectedByProbeRehomes(t *testing.T) {
	cfg := testConfig(6)
	cfg.MinRegions = 2
	c, _ := NewCore(cfg, "r1", 3, nil, nil)
	c.Step(up("r1", "a", 10))
	confirm(c, c.Step(up("r2", "b", 11)), nil)
	before := owners(c)

	// Probes go out on schedule; r2's gets "no responders".
	var acts []Action
	for range cfg.ProbeEvery {
		acts = append(acts, c.Tick()...)
	}
	var probeR2 Send
	for _, a := range acts {
		if s, ok := a.(Send); ok && s.Region == "r2" && s.Command.Kind == protocol.CmdProbe {
			probeR2 = s
		}
	}
	if probeR2.Region == "" {
		t.Fatalf("no probe of r2 after %d ticks: %v", cfg.ProbeEvery, describe(acts))
	}
	acts = c.Step(CommandDone{Send: probeR2, Outcome: NoResponders})
	d := describe(acts)
	if d[0] != "remove r2 rev11" {
		t.Fatalf("want the dead registration removed first, got %v", d)
	}
	wantBind := fmt.Sprintf("send bind r1/a e3 %v", before["r2"])
	if count(d, wantBind) != 1 {
		t.Fatalf("want %q, got %v", wantBind, d)
	}
	confirm(c, acts, nil)
	if o := owners(c); len(o["r1"]) != 6 {
		t.Fatalf("r1 should own all 6 shards, got %v", o)
	}
	assertAllActive(t, c)
	// r1's own shards were not touched.
	for _, l := range d {
		for _, sh := range before["r1"] {
			if strings.HasPrefix(l, fmt.Sprintf("write %d ", sh)) {
				t.Fatalf("shard %d of the live region was rewritten: %s", sh, l)
			}
		}
	}
}

func TestRegistrationExpiryRehomes(t *testing.T) {
	c, _ := NewCore(testConfig(4), "r1", 1, nil, nil)
	confirm(c, c.Step(up("r1", "a", 1)), nil)
	d := describe(c.Step(RegionGone{ID: "r1"}))
	// No region left: shards are recorded unowned, nothing is sent.
	if count(d, "write ") != 4 || count(d, "send ") != 0 || count(d, "write 0 unowned") != 1 {
		t.Fatalf("got %v", d)
	}
	confirm(c, c.Step(up("r2", "x", 5)), nil)
	if o := owners(c); len(o["r2"]) != 4 {
		t.Fatalf("want all shards on r2, got %v", o)
	}
}

func TestFailoverKeepsLiveOwners(t *testing.T) {
	// What a new coordinator reads at takeover: shards 0-1 active on r1,
	// 2 allocating on r2, 3 active on r3 which is gone, 4 never written.
	table := []protocol.ShardRecord{
		{Shard: 0, Region: "r1", Incarnation: "a", State: protocol.StateActive, Order: 1, Epoch: 5},
		{Shard: 1, Region: "r1", Incarnation: "a", State: protocol.StateActive, Order: 2, Epoch: 5},
		{Shard: 2, Region: "r2", Incarnation: "b", State: protocol.StateAllocating, Order: 3, Epoch: 5},
		{Shard: 3, Region: "r3", Incarnation: "c", State: protocol.StateActive, Order: 4, Epoch: 5},
	}
	regions := []RegionSeen{
		{Info: protocol.RegionInfo{ID: "r1", Incarnation: "a"}, Revision: 1},
		{Info: protocol.RegionInfo{ID: "r2", Incarnation: "b"}, Revision: 2},
	}
	c, acts := NewCore(testConfig(5), "r2", 9, table, regions)
	d := describe(acts)
	for _, l := range d {
		if strings.HasPrefix(l, "write 0 ") || strings.HasPrefix(l, "write 1 ") {
			t.Fatalf("a shard with a live owner was rewritten: %v", d)
		}
	}
	for _, want := range []string{"send probe r1/a e9 []", "send probe r2/b e9 []", "send bind r2/b e9 [2]"} {
		if count(d, want) != 1 {
			t.Fatalf("want %q in %v", want, d)
		}
	}
	// Shard 3 (dead owner) and 4 (never allocated) get new owners.
	if count(d, "write 3 unowned") != 1 || count(d, "write 3 allocating") != 1 || count(d, "write 4 allocating") != 1 {
		t.Fatalf("want shards 3 and 4 reallocated, got %v", d)
	}
	confirm(c, acts, map[string][]int{"r1": {0, 1}, "r2": {2}})
	assertAllActive(t, c)
	if o := owners(c); !slices.Contains(o["r1"], 0) || !slices.Contains(o["r1"], 1) {
		t.Fatalf("shards 0 and 1 moved: %v", o)
	}
}

func TestStaleEpochRefusalStepsDown(t *testing.T) {
	c, _ := NewCore(testConfig(2), "r1", 4, nil, nil)
	acts := c.Step(up("r1", "a", 1))
	bind := acts[len(acts)-1].(Send)
	d := describe(c.Step(CommandDone{Send: bind, Outcome: Refused, Reply: protocol.Reply{Epoch: 6, Incarnation: "a", Error: "stale epoch"}}))
	if len(d) != 1 || d[0] != "stepdown" {
		t.Fatalf("want stepdown, got %v", d)
	}
	// Shards stay allocating: the refused bind did not make them active.
	for _, r := range c.Table() {
		if r.State == protocol.StateActive {
			t.Fatalf("shard %d active after a refused bind", r.Shard)
		}
	}
}

func TestNewIncarnationLosesOldShards(t *testing.T) {
	c, _ := NewCore(testConfig(3), "r1", 1, nil, nil)
	confirm(c, c.Step(up("r1", "a", 1)), nil)
	d := describe(c.Step(up("r1", "a2", 9)))
	if count(d, "send bind r1/a2 e1 [0 1 2]") != 1 {
		t.Fatalf("want all shards bound to the new incarnation, got %v", d)
	}
	// A late confirmation from the old incarnation changes nothing.
	late := Send{Region: "r1", Command: protocol.Command{Kind: protocol.CmdBind, Epoch: 1, Incarnation: "a", Shards: []int{0}}}
	if acts := c.Step(CommandDone{Send: late, Outcome: OK}); len(acts) != 0 {
		t.Fatalf("late answer of a dead incarnation acted on: %v", describe(acts))
	}
}

func TestProbeReconciles(t *testing.T) {
	cfg := testConfig(4)
	cfg.MinRegions = 2
	c, _ := NewCore(cfg, "r1", 2, nil, nil)
	c.Step(up("r1", "a", 1))
	confirm(c, c.Step(up("r2", "b", 2)), nil)
	o := owners(c)
	// r1 claims one of r2's shards and lacks one of its own.
	claim := []int{o["r1"][0], o["r2"][0]}
	probe := Send{Region: "r1", Command: protocol.Command{Kind: protocol.CmdProbe, Epoch: 2, Incarnation: "a"}}
	d := describe(c.Step(CommandDone{Send: probe, Outcome: OK, Reply: protocol.Reply{Epoch: 2, Incarnation: "a", Held: claim}}))
	want := []string{
		fmt.Sprintf("send drop r1/a e2 [%d]", o["r2"][0]),
		fmt.Sprintf("send bind r1/a e2 [%d]", o["r1"][1]),
	}
	if !slices.Equal(d, want) {
		t.Fatalf("got %v, want %v", d, want)
	}
}

func TestUnconfirmedBindIsRetried(t *testing.T) {
	cfg := testConfig(2)
	c, _ := NewCore(cfg, "r1", 1, nil, nil)
	acts := c.Step(up("r1", "a", 1))
	bind := acts[len(acts)-1].(Send)
	c.Step(CommandDone{Send: bind, Outcome: Failed})
	var resent int
	for range cfg.BindRetry {
		resent += count(describe(c.Tick()), "send bind r1/a e1 [0 1]")
	}
	if resent != 1 {
		t.Fatalf("want one resend within %d ticks, got %d", cfg.BindRetry, resent)
	}
}

func TestDeterministic(t *testing.T) {
	run := func() []string {
		cfg := testConfig(32)
		cfg.MinRegions = 3
		c, _ := NewCore(cfg, "r1", 1, nil, nil)
		var log []string
		for _, ev := range []Event{up("r3", "c", 3), up("r1", "a", 1), up("r2", "b", 2)} {
			acts := c.Step(ev)
			log = append(log, describe(acts)...)
			log = append(log, describe(confirm(c, acts, nil))...)
		}
		log = append(log, describe(c.Step(RegionGone{ID: "r2"}))...)
		return log
	}
	a, b := run(), run()
	if !slices.Equal(a, b) {
		t.Fatalf("same inputs, different outputs")
	}
}
