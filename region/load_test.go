package region_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// idsOf returns n entity ids of shard.
func idsOf(shard, n int) []string {
	var ids []string
	for i := 0; len(ids) < n; i++ {
		if id := fmt.Sprintf("e%d", i); protocol.ShardOf(id, shards) == shard {
			ids = append(ids, id)
		}
	}
	return ids
}

// TestProbeReportsLoad: the answer to a probe carries, for every held
// shard whose rate has been measured, its message rate and live entities.
func TestProbeReportsLoad(t *testing.T) {
	f := newFixture(t)
	f.bind(t, f.epoch, 1, 3)
	ids := idsOf(1, 3)
	natstest.Eventually(t, 10*time.Second, "a measured load in a probe answer", func() bool {
		for _, id := range ids {
			if _, err := f.nc.Request(f.subjects.Entity(1, id), []byte("x"), 2*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		r := f.send(t, protocol.Command{Kind: protocol.CmdProbe, Epoch: f.epoch, Incarnation: f.inc})
		var one, three *protocol.ShardLoad
		for i := range r.Load {
			switch r.Load[i].Shard {
			case 1:
				one = &r.Load[i]
			case 3:
				three = &r.Load[i]
			default:
				t.Fatalf("load of a shard not held: %+v", r.Load)
			}
		}
		if one == nil || one.Rate == 0 {
			return false
		}
		if one.Entities != 3 || three == nil || three.Rate != 0 || three.Entities != 0 {
			t.Fatalf("load %+v", r.Load)
		}
		return true
	})
}

// TestQuery: a region answers queries about its shards and entities on
// its query subject, in JSON; bad queries get an error answer.
func TestQuery(t *testing.T) {
	f := newFixture(t)
	f.bind(t, f.epoch, 1, 3, 6)
	ids := idsOf(3, 4)
	for _, id := range ids {
		if _, err := f.nc.Request(f.subjects.Entity(3, id), []byte("x"), 2*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	ask := func(body string) (protocol.QueryAnswer, string) {
		t.Helper()
		m, err := f.nc.Request(f.subjects.Query("r1"), []byte(body), 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var ans protocol.QueryAnswer
		var e protocol.AdminError
		if err := json.Unmarshal(m.Data, &ans); err != nil {
			t.Fatalf("%q: %v", m.Data, err)
		}
		_ = json.Unmarshal(m.Data, &e)
		return ans, e.Error
	}
	// The shards go live once their replays reach the markers.
	var ans protocol.QueryAnswer
	natstest.Eventually(t, 10*time.Second, "every shard live", func() error {
		ans, _ = ask(``)
		for _, s := range ans.Shards {
			if s.Mode != "live" {
				return fmt.Errorf("%+v", ans)
			}
		}
		if len(ans.Shards) < 3 {
			return fmt.Errorf("%+v", ans)
		}
		return nil
	})
	if ans.Region != "r1" || ans.Incarnation != f.inc || len(ans.Shards) != 3 {
		t.Fatalf("all shards: %+v", ans)
	}
	for _, s := range ans.Shards {
		want := map[int]int{1: 0, 3: 4, 6: 0}[s.Shard]
		if s.Mode != "live" || s.Entities != want || s.EntityIDs != nil {
			t.Fatalf("shard report %+v, want %d entities and no ids", s, want)
		}
	}
	slices.Sort(ids)
	ans, _ = ask(`{"shards":[3,5],"entities":true}`)
	if len(ans.Shards) != 1 || !slices.Equal(ans.Shards[0].EntityIDs, ids) || ans.Shards[0].Truncated {
		t.Fatalf("shard 3 with ids: %+v, want %v", ans, ids)
	}
	ans, _ = ask(`{"shards":[3],"entities":true,"limit":2}`)
	if s := ans.Shards[0]; !slices.Equal(s.EntityIDs, ids[:2]) || !s.Truncated || s.Entities != 4 {
		t.Fatalf("limit 2: %+v", s)
	}
	for body, want := range map[string]string{
		`{"shards":[8]}`:    "out of range",
		`{"limit":-1}`:      "limit -1",
		`{"entity":true}`:   "unknown field",
		`{"shards":[1]} {}`: "trailing data",
	} {
		if _, e := ask(body); !strings.Contains(e, want) {
			t.Errorf("%s: error %q, want %q", body, e, want)
		}
	}
}
