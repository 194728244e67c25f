package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/natshard/natshard/protocol"
)

// TestWait: --wait prints its progress on stderr and the result on
// stdout; a move that cannot end times out saying what it waited for and
// what is still not done; undrain is refused while the region holds a
// shard.
func TestWait(t *testing.T) {
	s := startSystem(t, 4, "r1", "r2")

	out, stderr, err := ctl(t, s.url, "move", "0", "r2", "--wait", "--timeout", "30s")
	if err != nil || out != "moving shard 0 to r2\nshard 0 is active on r2\n" {
		t.Fatalf("move --wait: %q %v", out, err)
	}
	for _, want := range []string{"waiting for shard 0 to be active on r2", "shard 0 handing off from r1\n", "shard 0 binding on r2, replaying its buffer (from r1)\n", "shard 0 active on r2\n"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("move --wait's progress lacks %q:\n%s", want, stderr)
		}
	}
	s.waitLive(t, "r2")

	// r3 answers probes and refuses everything else: a shard moved there
	// stays binding.
	stop, leave := s.silentRegionLeaving(t, "r3")
	s.waitTable(t, "r3 registered", func(st protocol.Status) bool { return len(st.Regions) == 3 })
	_, stderr, err = ctl(t, s.url, "move", "1", "r3", "--wait", "--timeout", "3s")
	if exitCode(err) != 1 || !strings.HasPrefix(err.Error(), "timed out after 3s (--timeout) waiting for shard 1 to be active on r3: shard 1 is ") {
		t.Fatalf("move --wait to a region that never binds: %v\n%s", err, stderr)
	}
	s.waitTable(t, "shard 1 binding on r3", func(st protocol.Status) bool {
		return st.Table[1].State == "binding" && st.Table[1].Region == "r3"
	})
	// r3 refuses the drain too (it answers probes only): the timeout says
	// that it is not leaving.
	_, _, err = ctl(t, s.url, "drain", "r3", "--wait", "--timeout", "2s")
	if exitCode(err) != 1 || !strings.Contains(err.Error(), "waiting for region r3 to hand off all of its shards: 1 shard still on r3: 1; r3 is not marked leaving: it did not get the drain") {
		t.Fatalf("drain --wait of a region that refuses it: %v", err)
	}
	// r3 leaves while shard 1 is binding there: undrain is refused.
	leave()
	s.waitTable(t, "r3 leaving", func(st protocol.Status) bool {
		for _, r := range st.Regions {
			if r.ID == "r3" {
				return r.Leaving
			}
		}
		return false
	})
	_, _, err = ctl(t, s.url, "undrain", "r3")
	if exitCode(err) != 1 || !strings.Contains(err.Error(), "undrain refused: coordinator: region holds shards: region r3 still holds 1 shard: it is being drained, or its process is stopping") {
		t.Fatalf("undrain of a region holding a shard: %v", err)
	}
	stop()
	s.waitTable(t, "r3 gone, every shard active", func(st protocol.Status) bool {
		for _, r := range st.Table {
			if r.State != "active" {
				return false
			}
		}
		return len(st.Regions) == 2
	})

	// --json --wait: one JSON object, once done.
	out, _, err = ctl(t, s.url, "drain", "r2", "--wait", "--timeout", "30s", "--json")
	var res changeJSON
	if err != nil || json.Unmarshal([]byte(out), &res) != nil || res.Done != "region r2 holds no shard" {
		t.Fatalf("drain --wait --json: %q %v", out, err)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"rebalance", "--wait", "--dry-run"}, "--wait and --dry-run"},
		{[]string{"status", "--wait"}, "--wait is not a flag of status"},
		{[]string{"pin", "1", "r1", "--wait"}, "--wait is not a flag of pin"},
	} {
		if _, _, err := ctl(t, s.url, tc.args...); exitCode(err) != 2 || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want a usage error with %q", tc.args, err, tc.want)
		}
	}
}
