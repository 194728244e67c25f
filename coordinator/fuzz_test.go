package coordinator

import (
	"encoding/json"
	"maps"
	"slices"
	"testing"
)

// FuzzAdminRequest feeds arbitrary admin API requests (verb and JSON
// body, as they arrive on <control>.<type>.admin.<verb>) to a coordinator
// core whose 16 shards are settled on three regions. It never panics; a
// refused request answers an error and changes nothing (table, pins, no
// action); an accepted one answers a body that encodes as JSON, and its
// actions, carried out by the simulated regions, keep docs/FAULTS.md's
// single-owner invariant and end with every shard active and served.
// Seeds: testdata/fuzz/FuzzAdminRequest.
func FuzzAdminRequest(f *testing.F) {
	for _, seed := range [][2]string{
		{"move", `{"shard":3,"region":"b"}`},
		{"drain", `{"region":"a"}`},
		{"undrain", `{"region":"a"}`},
		{"pin", `{"shard":2,"region":"c"}`},
		{"unpin", `{"shard":2}`},
		{"rebalance", `{"dry_run":true}`},
		{"rebalance", ``},
	} {
		f.Add(seed[0], []byte(seed[1]))
	}
	f.Fuzz(func(t *testing.T, verb string, body []byte) {
		cfg := testConfig(16)
		cfg.MinRegions, cfg.RebalanceEvery = 3, -1
		s := newSim(t, cfg)
		for _, r := range []string{"a", "b", "c"} {
			s.join(r)
		}
		s.settled()
		table, pins := s.c.Table(), s.c.Pins()
		ans, acts, err := s.c.AdminRequest(verb, body)
		if err != nil {
			if ans != nil || acts != nil {
				t.Fatalf("%s %q refused (%v) with an answer %v or actions %v", verb, body, err, ans, acts)
			}
			if !slices.Equal(table, s.c.Table()) || !maps.Equal(pins, s.c.Pins()) {
				t.Fatalf("%s %q refused (%v) but changed the core", verb, body, err)
			}
			return
		}
		if _, err := json.Marshal(ans); err != nil {
			t.Fatalf("%s %q: answer %#v does not encode: %v", verb, body, ans, err)
		}
		s.run(acts)
		s.ticks(2 * cfg.HandOffTimeout)
		s.settled()
	})
}
