package campaign

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

func sends(outcome Outcome, values ...int) []Send {
	var out []Send
	for _, v := range values {
		out = append(out, Send{Value: v, At: time.Duration(v) * time.Second, Outcome: outcome})
	}
	return out
}

// TestCheck: each kind of violation, keyed and keyless, in both modes.
func TestCheck(t *testing.T) {
	faults := []Fault{
		{ID: 1, Kind: KillRegion, At: 2 * time.Second, Heal: 3 * time.Second, Region: 0, Server: -1, Peer: -1, Shard: -1},
		{ID: 2, Kind: MoveShard, At: 30 * time.Second, Heal: 30 * time.Second, Region: 1, Server: -1, Peer: -1, Shard: 4},
	}
	unknown := sends(Unknown, 6, 7)
	entities := []Entity{
		{ID: "ok", Keyed: true, Sends: sends(Acked, 1, 2, 3), History: []int{1, 2, 3}},
		// 2 lost (fault 1 in force), 3 applied twice, 5 before 4
		{ID: "bad", Keyed: true, Sends: sends(Acked, 1, 2, 3, 4, 5), History: []int{1, 3, 3, 5, 4}},
		// 6 unknown and applied, 7 unknown and not, 8 never sent
		{ID: "unk", Keyed: false, Sends: append(sends(Acked, 5), unknown...), History: []int{5, 6, 8}},
		// sent (core publish) and lost long after every fault; refused and applied
		{ID: "pub", Keyed: false, Sends: append(sends(Sent, 20), sends(Refused, 21)...), History: []int{21}},
	}
	rep := Check(Durable, entities, faults)
	got := map[string]ViolationKind{}
	for _, v := range rep.Violations {
		got[v.Entity+"/"+strconv.Itoa(v.Value)] = v.Kind
	}
	want := map[string]ViolationKind{
		"bad/2": Lost, "bad/3": Twice, "bad/4": OutOfOrder,
		"unk/8": Phantom, "pub/20": Lost, "pub/21": Phantom,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("violations %v, want %v", got, want)
	}
	if rep.Keyed.Entities != 2 || rep.Keyless.Entities != 2 || rep.Keyless.UnknownApplied != 1 || rep.Keyless.Sent[Unknown] != 2 {
		t.Errorf("counts: keyed %+v keyless %+v", rep.Keyed, rep.Keyless)
	}
	if rep.Keyless.LostSent != 1 || rep.Keyless.LostUnattributed != 1 || rep.Keyed.LostUnattributed != 0 {
		t.Errorf("losses: keyed %+v keyless %+v", rep.Keyed, rep.Keyless)
	}
	for _, v := range rep.Violations {
		if v.Entity == "bad" && v.Value == 2 && !reflect.DeepEqual(v.InForce, []int{1}) {
			t.Errorf("bad/2 attributed to %v, want fault 1 in force", v.InForce)
		}
		if v.Entity == "bad" && v.Value == 4 && (len(v.InForce) != 0 || !reflect.DeepEqual(v.Recent, []int{1})) {
			t.Errorf("bad/4 attributed to %v and %v, want fault 1 recent", v.InForce, v.Recent)
		}
		if v.Entity == "pub" && v.Value == 21 && !reflect.DeepEqual(v.Later, []int{2}) {
			t.Errorf("pub/21 attributed to %v later, want fault 2", v.Later)
		}
		if v.Entity == "bad" && v.Value == 4 && v.History != "1 3 3 5 [4]" {
			t.Errorf("bad/4 history %q", v.History)
		}
	}
	if rep.ByFault[1][Lost] != 1 || rep.ByFault[2] != nil {
		t.Errorf("by fault: %v", rep.ByFault)
	}
	if f := rep.Failures(); f[Lost] != 2 || f[Twice] != 1 || f[OutOfOrder] != 1 || f[Phantom] != 2 {
		t.Errorf("durable failures %v", f)
	}

	// Core: losses and keyless doubles are reported, not failures.
	entities = append(entities, Entity{ID: "dup", Sends: sends(Sent, 1, 2), History: []int{1, 2, 1}})
	rep = Check(Core, entities, faults)
	if f := rep.Failures(); !reflect.DeepEqual(f, map[ViolationKind]int{Twice: 1, OutOfOrder: 1, Phantom: 2}) {
		t.Errorf("core failures %v", f)
	}
	if rep.Keyless.Violations[Twice] != 1 {
		t.Errorf("keyless twice %d, want 1", rep.Keyless.Violations[Twice])
	}
	lines := rep.Lines(1)
	for _, l := range lines {
		if !strings.HasPrefix(l, "campaign: core ") {
			t.Errorf("line %q", l)
		}
	}
	if !strings.Contains(strings.Join(lines, "\n"), "entity bad value 3 (acked, sent at 3s): 1 3 [3] 5 4; faults in force [1], healed within 10s before [], started within 10s after []") {
		t.Errorf("lines:\n%s", strings.Join(lines, "\n"))
	}
}
