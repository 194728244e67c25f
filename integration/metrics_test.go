package integration

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrape is one parse of a shardd's /metrics.
type scrape map[string]*dto.MetricFamily

// get sums the samples of family name whose labels include want (a
// histogram's: its count).
func (s scrape) get(name string, want ...string) float64 {
	var sum float64
	mf := s[name]
	if mf == nil {
		return 0
	}
next:
	for _, m := range mf.GetMetric() {
		for i := 0; i+1 < len(want); i += 2 {
			if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == want[i] && l.GetValue() == want[i+1] }) {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Histogram != nil:
			sum += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return sum
}

// scrapeMetrics reads and parses http://addr/metrics.
func scrapeMetrics(t *testing.T, addr string) scrape {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s %s", addr, resp.Status, body)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("parse /metrics of %s: %v", addr, err)
	}
	return scrape(fams)
}

// TestMetricsScripted runs three shardd --http, then a scripted history: a
// malformed message, requests to one entity (one of them failing), a move
// of its shard, a kill -9 of a region. After each step it scrapes every
// process's /metrics and checks that each counter moved by what the step
// explains, on the process the step concerns, and nowhere else.
func TestMetricsScripted(t *testing.T) {
	const shards = 8
	url := natstest.URL(natstest.RunServer(t))
	subjects := protocol.MustSubjects("", "", "kv")
	names := []string{"a", "b", "c"}
	addrs := map[string]string{}
	procs := map[string]*proc{}
	for _, r := range names {
		addrs[r] = fmt.Sprintf("127.0.0.1:%d", freePort(t))
		procs[r] = startShardd(t, r, "--nats", url, "--region", r, "--type", "kv", "--kind", "kv", "--shards", fmt.Sprint(shards),
			"--min-regions", "3", "--rebalance-interval", "0", "--http", addrs[r])
	}
	nc := connect(t, url)
	st := waitSettled(t, nc, subjects, 60*time.Second, names...)
	for _, r := range names {
		natstest.Eventually(t, 30*time.Second, "region "+r+" ready", func() error {
			resp, err := http.Get("http://" + addrs[r] + "/readyz")
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("/readyz %s", resp.Status)
			}
			return nil
		})
	}
	coord := st.Coordinator.Region
	owner := owners(st)
	scrapeAll := func() map[string]scrape {
		out := map[string]scrape{}
		for r, addr := range addrs {
			if procs[r] != nil {
				out[r] = scrapeMetrics(t, addr)
			}
		}
		return out
	}
	// check compares the counters of every live process before and after
	// a step with what the step explains: want[region][metric] is the
	// expected increase (absent: none). Each metric is a name and labels.
	type metric struct{ name, label, value string } // at most one label
	m := func(name string, label ...string) metric {
		if len(label) == 2 {
			return metric{name, label[0], label[1]}
		}
		return metric{name: name}
	}
	labels := func(mt metric) []string {
		if mt.label == "" {
			return nil
		}
		return []string{mt.label, mt.value}
	}
	region := []metric{
		m("natshard_messages_delivered_total"), m("natshard_messages_refused_total", "reason", "malformed"),
		m("natshard_messages_refused_total", "reason", "not_owned"), m("natshard_messages_refused_total", "reason", "buffer_full"),
		m("natshard_messages_refused_total", "reason", "held_limit"), m("natshard_messages_refused_total", "reason", "stopping"),
		m("natshard_messages_handled_total"), m("natshard_messages_failed_total"), m("natshard_entity_activations_total"),
		m("natshard_entity_passivations_total"), m("natshard_messages_buffered_total"), m("natshard_region_fenced_total"),
		m("natshard_handoff_duration_seconds", "step", "stop"), m("natshard_handoff_duration_seconds", "step", "replay"),
	}
	coordinator := []metric{
		m("natshard_handoffs_started_total"), m("natshard_handoffs_completed_total"), m("natshard_handoffs_timed_out_total"),
		m("natshard_handoffs_forced_total"), m("natshard_rebalance_rounds_total"), m("natshard_coordinator_terms_total"),
		m("natshard_handoff_duration_seconds", "step", "pause"), m("natshard_handoff_duration_seconds", "step", "bind"),
		m("natshard_handoff_duration_seconds", "step", "move"),
	}
	check := func(step string, before, after map[string]scrape, want map[string]map[metric]float64) {
		t.Helper()
		for r, a := range after {
			for _, mt := range slices.Concat(region, coordinator) {
				got := a.get(mt.name, labels(mt)...) - before[r].get(mt.name, labels(mt)...)
				if w := want[r][mt]; got != w {
					t.Errorf("%s: %s%v on %s moved by %v, want %v", step, mt.name, labels(mt), r, got, w)
				}
			}
		}
	}
	base := scrapeAll()
	for _, r := range names {
		if got := base[r].get("natshard_coordinator_leader"); got != map[bool]float64{true: 1}[r == coord] {
			t.Errorf("natshard_coordinator_leader of %s: %v (the coordinator is %s)", r, got, coord)
		}
		if got := base[r].get("natshard_region_shards", "mode", "live"); int(got) != countOwned(owner, r) {
			t.Errorf("natshard_region_shards{mode=live} of %s: %v, want %d", r, got, countOwned(owner, r))
		}
		if got := base[r].get("natshard_region_registered"); got != 1 {
			t.Errorf("natshard_region_registered of %s: %v", r, got)
		}
	}
	if got := base[coord].get("natshard_coordinator_epoch"); uint64(got) != st.Coordinator.Epoch {
		t.Errorf("natshard_coordinator_epoch %v, status says %d", got, st.Coordinator.Epoch)
	}
	if got := base[coord].get("natshard_coordinator_shards", "state", "active"); got != shards {
		t.Errorf("natshard_coordinator_shards{state=active} %v, want %d", got, shards)
	}

	// 1. A malformed message: an id that does not hash to the shard of its
	// subject, as a request. Its shard's owner refuses and counts it.
	id := "order-42"
	home := protocol.ShardOf(id, shards)
	wrong := (home + 1) % shards
	reply, err := nc.Request(subjects.Entity(wrong, id), []byte(`{"op":"get"}`), 5*time.Second)
	if err != nil || reply.Header.Get(protocol.HeaderRefused) != protocol.RefusedMalformed {
		t.Fatalf("malformed request: %v %v", err, reply)
	}
	after := scrapeAll()
	check("a malformed message", base, after, map[string]map[metric]float64{
		owner[wrong]: {m("natshard_messages_refused_total", "reason", "malformed"): 1},
	})

	// 2. Five requests to one entity, one of them a bad request.
	before := after
	for i, body := range []string{`{"op":"set","key":"k","value":1}`, `{"op":"incr","key":"k"}`, `{"op":"frobnicate"}`, `{"op":"get"}`, `{"op":"get","key":"k"}`} {
		_, err := kvRequest(t.Context(), nc, subjects.EntityOf(id, shards), body)
		if (i == 2) != (err != nil) {
			t.Fatalf("request %s: %v", body, err)
		}
	}
	after = scrapeAll()
	check("five requests, one failing", before, after, map[string]map[metric]float64{
		owner[home]: {m("natshard_messages_delivered_total"): 5, m("natshard_messages_handled_total"): 5, m("natshard_messages_failed_total"): 1, m("natshard_entity_activations_total"): 1},
	})

	// 3. A move of the entity's shard to another region, then a request
	// there.
	from := owner[home]
	to := map[string]string{"a": "b", "b": "c", "c": "a"}[from]
	before = after
	resp, err := nc.Request(subjects.Admin(protocol.AdminMove), fmt.Appendf(nil, `{"shard":%d,"region":%q}`, home, to), 5*time.Second)
	if err != nil || !strings.Contains(string(resp.Data), `"ok":true`) {
		t.Fatalf("move: %v %s", err, resp.Data)
	}
	natstest.Eventually(t, 30*time.Second, "the move done", func() error {
		s, err := status(nc, subjects)
		if err != nil {
			return err
		}
		if r := s.Table[home]; r.State != "active" || r.Region != to {
			return fmt.Errorf("shard %d %s on %s", home, r.State, r.Region)
		}
		return nil
	})
	if _, err := kvRequest(t.Context(), nc, subjects.EntityOf(id, shards), `{"op":"get","key":"k"}`); err != nil {
		t.Fatal(err)
	}
	// The region steps end a moment after the table says active.
	natstest.Eventually(t, 10*time.Second, "the steps observed", func() error {
		after = scrapeAll()
		if after[to].get("natshard_handoff_duration_seconds", "step", "replay") == before[to].get("natshard_handoff_duration_seconds", "step", "replay") {
			return fmt.Errorf("no replay observed on %s yet", to)
		}
		return nil
	})
	want := map[string]map[metric]float64{
		from: {m("natshard_handoff_duration_seconds", "step", "stop"): 1},
		to: {m("natshard_handoff_duration_seconds", "step", "replay"): 1, m("natshard_messages_delivered_total"): 1,
			m("natshard_messages_handled_total"): 1, m("natshard_entity_activations_total"): 1},
	}
	for k, v := range map[metric]float64{
		m("natshard_handoffs_started_total"): 1, m("natshard_handoffs_completed_total"): 1,
		m("natshard_handoff_duration_seconds", "step", "pause"): 1, m("natshard_handoff_duration_seconds", "step", "bind"): 1,
		m("natshard_handoff_duration_seconds", "step", "move"): 1,
	} {
		if want[coord] == nil {
			want[coord] = map[metric]float64{}
		}
		want[coord][k] = v
	}
	check("a move", before, after, want)
	if got := after[from].get("natshard_entities_active"); got != 0 {
		t.Errorf("%s still holds %v entities after its only one moved", from, got)
	}

	// 4. kill -9 of a region that is not the coordinator: its shards are
	// parked and bound to the others (a bind each, no handoff: nothing
	// was live to hand off).
	victim := ""
	for _, r := range names {
		if r != coord && countOwned(owners(mustStatus(t, nc, subjects)), r) > 0 {
			victim = r
		}
	}
	if victim == "" {
		t.Fatalf("no region but the coordinator %s holds shards", coord)
	}
	lost := countOwned(owners(mustStatus(t, nc, subjects)), victim)
	before = scrapeAll()
	procs[victim].kill()
	procs[victim] = nil
	live := slices.DeleteFunc(slices.Clone(names), func(r string) bool { return r == victim })
	waitSettled(t, nc, subjects, 60*time.Second, live...)
	natstest.Eventually(t, 10*time.Second, "the replays observed", func() error {
		after = scrapeAll()
		var n float64
		for _, r := range live {
			n += after[r].get("natshard_handoff_duration_seconds", "step", "replay") - before[r].get("natshard_handoff_duration_seconds", "step", "replay")
		}
		if int(n) != lost {
			return fmt.Errorf("%v replays observed, want %d", n, lost)
		}
		return nil
	})
	want = map[string]map[metric]float64{coord: {m("natshard_handoff_duration_seconds", "step", "bind"): float64(lost)}}
	for _, r := range live {
		if n := after[r].get("natshard_handoff_duration_seconds", "step", "replay") - before[r].get("natshard_handoff_duration_seconds", "step", "replay"); n > 0 {
			if want[r] == nil {
				want[r] = map[metric]float64{}
			}
			want[r][m("natshard_handoff_duration_seconds", "step", "replay")] = n
		}
	}
	check("kill -9 of "+victim, before, after, want)
	if got := after[coord].get("natshard_coordinator_shards", "state", "active"); got != shards {
		t.Errorf("after the kill: natshard_coordinator_shards{state=active} %v, want %d", got, shards)
	}
	t.Logf("metrics after the history (coordinator %s, moved shard %d %s->%s, killed %s with %d shards): every counter moved as explained", coord, home, from, to, victim, lost)
}

func mustStatus(t *testing.T, nc *nats.Conn, subjects protocol.Subjects) protocol.Status {
	t.Helper()
	st, err := status(nc, subjects)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
