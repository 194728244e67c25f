package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/google/pprof/profile"

	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
)

// bench runs shardctl with args and decodes its JSON output.
func benchJSON(t testing.TB, args ...string) benchlab.Result {
	t.Helper()
	res, _ := benchJSONRaw(t, args...)
	return res
}

// benchJSONRaw is benchJSON that also returns the JSON as generic
// values, to check the field names.
func benchJSONRaw(t testing.TB, args ...string) (benchlab.Result, map[string]any) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
	if err != nil {
		t.Fatalf("shardctl %v: %v\n%s", args, err, stderr.String())
	}
	var res benchlab.Result
	var raw map[string]any
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		t.Fatalf("shardctl %v printed no JSON: %v\n%s", args, err, stdout.String())
	}
	if err := json.Unmarshal(stdout.Bytes(), &raw); err != nil {
		t.Fatal(err)
	}
	return res, raw
}

// checkCounts checks what must hold whatever the machine's speed: every
// message sent was received on each side, rates and the ratio are
// positive, every request was answered.
func checkCounts(t *testing.T, res benchlab.Result, msgs, rounds, requests int) {
	t.Helper()
	for name, side := range map[string]benchlab.ThroughputSide{"natshard": res.Throughput.Natshard, "raw": res.Throughput.Raw} {
		if want := int64(msgs * rounds); side.Sent != want || side.Received != want {
			t.Errorf("%s: sent %d, received %d, want %d each", name, side.Sent, side.Received, want)
		}
		if len(side.RoundsPerSec) != rounds || side.MsgsPerSec <= 0 {
			t.Errorf("%s: rates %v, median %v", name, side.RoundsPerSec, side.MsgsPerSec)
		}
	}
	if res.Ratio <= 0 || res.Ratio != res.Throughput.Ratio || len(res.Throughput.RoundsRatio) != rounds {
		t.Errorf("ratio %v, throughput ratio %v", res.Ratio, res.Throughput.Ratio)
	}
	l := res.Latency
	if l == nil {
		t.Fatal("no latency run")
	}
	for name, side := range map[string]benchlab.LatencySide{"natshard": l.Natshard, "raw": l.Raw} {
		if side.Count != requests || side.Errors != 0 || side.P50US <= 0 || side.P50US > side.P99US || side.P99US > side.P999US || side.P999US > side.MaxUS {
			t.Errorf("%s latency: %+v, want %d requests answered and ordered percentiles", name, side, requests)
		}
	}
	cr := res.Concurrent
	if cr == nil {
		t.Fatal("no concurrent callers' run")
	}
	for name, side := range map[string]benchlab.ConcurrentSide{"natshard": cr.Natshard, "raw": cr.Raw} {
		if side.Errors != 0 || side.ReqsPerSec <= 0 || len(side.RoundsPerSec) != benchlab.RequestRounds {
			t.Errorf("%s concurrent callers: %+v, want no error and %d positive rates", name, side, benchlab.RequestRounds)
		}
	}
	if cr.Callers != res.Config.Callers || cr.Requests != benchlab.RequestFactor*requests || cr.Ratio <= 0 || len(cr.RoundsRatio) != benchlab.RequestRounds {
		t.Errorf("concurrent callers: %+v, config %+v", cr, res.Config)
	}
}

// TestBench runs shardctl bench with tiny sizes against a NATS server of
// the test, then on an embedded server with handoff and failover runs, and
// checks the counts, never a time.
func TestBench(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	res := benchJSON(t, "--nats", url, "bench", "--json", "--shards", "16", "--entities", "40",
		"--msgs", "3000", "--pubs", "3", "--rounds", "2", "--requests", "120", "--window", "100")
	checkCounts(t, res, 3000, 2, 120)
	if res.Config.Server != url || !strings.HasPrefix(res.Config.Type, "bench-") {
		t.Errorf("config %+v", res.Config)
	}
	// The bench type is gone from the server it was given.
	nc := natstest.Connect(t, url)
	js := natstest.JetStream(t, nc)
	if _, err := js.KeyValue(context.Background(), kvstate.BucketName(res.Config.Type)); err == nil {
		t.Errorf("bucket of type %s left on the server", res.Config.Type)
	}
	if _, err := js.Stream(context.Background(), kvstate.BufferStream(res.Config.Type)); err == nil {
		t.Errorf("buffer stream of type %s left on the server", res.Config.Type)
	}

	res = benchJSON(t, "bench", "--json", "--regions", "3", "--shards", "8", "--entities", "10", "--msgs", "500",
		"--rounds", "1", "--requests", "50", "--handoff", "--handoff-entities", "20", "--moves", "2",
		"--failover", "--kills", "1", "--rate", "500", "--progress")
	checkCounts(t, res, 500, 1, 50)
	if res.Config.Server != "embedded" || res.Config.Type != "bench" {
		t.Errorf("config %+v", res.Config)
	}
	if p := res.Pipelined; p == nil || p.Window != benchlab.PipelineWindow || p.Requests != benchlab.RequestFactor*50 || len(p.RoundsRatio) != benchlab.RequestRounds || p.Ratio <= 0 ||
		p.Natshard.ReqsPerSec <= 0 || p.Raw.ReqsPerSec <= 0 || p.Natshard.Errors != 0 || p.Raw.Errors != 0 {
		t.Errorf("pipelined %+v", res.Pipelined)
	}
	if h := res.Handoff; h == nil || len(h.Samples) != 2 || h.P50MS <= 0 || h.MaxMS < h.P50MS {
		t.Errorf("handoff %+v", res.Handoff)
	}
	if f := res.Failover; f == nil || len(f.Rehomed) != 1 || f.RehomedP50MS <= 0 || f.ParkedP50MS <= 0 || f.ParkedP50MS > f.RehomedP50MS ||
		len(f.Coordinator) != 1 || f.CoordinatorP50MS <= 0 {
		t.Errorf("failover %+v", res.Failover)
	}
}

// checkDurable checks the durable run's figures whatever the machine's
// speed: every message published was acknowledged and handled on each
// side, the rates, ratios and percentiles are positive and finite.
func checkDurable(t *testing.T, d *benchlab.DurableResult, msgs, rounds, samples, replicas int) {
	t.Helper()
	if d == nil {
		t.Fatal("no durable run")
	}
	sane := func(name string, v float64) {
		if v <= 0 || math.IsInf(v, 0) || math.IsNaN(v) {
			t.Errorf("durable %s = %v, want positive and finite", name, v)
		}
	}
	tp := d.Throughput
	if tp.Best == nil {
		t.Fatal("no best-shape side")
	}
	for name, side := range map[string]benchlab.ThroughputSide{"natshard": tp.Natshard, "raw": tp.Raw, "best": *tp.Best} {
		if want := int64(msgs * rounds); side.Sent != want || side.Received != want || side.Acked != want || side.PublishErrors != 0 || side.Errors != 0 {
			t.Errorf("durable %s: sent %d, received %d, acked %d, publish errors %d, errors %d; want %d sent, received and acked",
				name, side.Sent, side.Received, side.Acked, side.PublishErrors, side.Errors, want)
		}
		if len(side.RoundsPerSec) != rounds {
			t.Errorf("durable %s: %d rounds, want %d", name, len(side.RoundsPerSec), rounds)
		}
		sane(name+" msgs/s", side.MsgsPerSec)
		for _, r := range side.RoundsPerSec {
			sane(name+" round msgs/s", r)
		}
		if side.CPUPerMsgUS < 0 || math.IsInf(side.CPUPerMsgUS, 0) || math.IsNaN(side.CPUPerMsgUS) {
			t.Errorf("durable %s: CPU per message %v", name, side.CPUPerMsgUS)
		}
	}
	sane("ratio", d.Ratio)
	sane("same-shape ratio", d.SameShapeRatio)
	sane("best CPU ratio", tp.BestCPURatio)
	if d.Ratio != tp.BestRatio || len(tp.BestRoundsRatio) != rounds || d.SameShapeRatio != tp.Ratio || len(tp.RoundsRatio) != rounds {
		t.Errorf("durable ratio %v, same-shape ratio %v; throughput: best %v, rounds %v, same shape %v, rounds %v",
			d.Ratio, d.SameShapeRatio, tp.BestRatio, tp.BestRoundsRatio, tp.Ratio, tp.RoundsRatio)
	}
	if d.Msgs != msgs || d.Storage != "file" || d.Replicas != replicas || d.Streams < 2 /* 4 or 8 shards: split */ || d.Stream != kvstate.MessageStreams(d.Type, d.Streams)[0] || d.Raw == "" || d.Raw == d.Stream ||
		d.Best == "" || d.Best == d.Raw || d.Best == d.Stream || d.BestConsumers != 1 {
		t.Errorf("durable run %+v", d)
	}
	l := d.Latency
	if l == nil {
		t.Fatal("no durable latency run")
	}
	for name, side := range map[string]benchlab.LatencySide{"natshard": l.Natshard, "raw": l.Raw} {
		if side.Count != samples || side.Errors != 0 || side.P50US <= 0 || side.P50US > side.P99US || side.P99US > side.P999US || side.P999US > side.MaxUS || math.IsInf(side.MaxUS, 0) {
			t.Errorf("durable %s latency: %+v, want %d samples and ordered percentiles", name, side, samples)
		}
	}
}

// TestBenchDurable runs both delivery modes in one run against a NATS
// server of the test, checks the durable figures and their JSON names,
// and that nothing of the bench is left on the server; then durable
// delivery alone, whose JSON has no core figures.
func TestBenchDurable(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	prefix := filepath.Join(t.TempDir(), "cpu")
	res, raw := benchJSONRaw(t, "--nats", url, "bench", "--json", "--delivery", "both", "--shards", "8", "--entities", "20",
		"--msgs", "400", "--pubs", "2", "--rounds", "2", "--requests", "40", "--window", "50", "--side-profiles", prefix)
	checkCounts(t, res, 400, 2, 40)
	// A CPU profile of each side's rounds, per delivery.
	for _, name := range []string{"core.natshard", "core.raw", "durable.natshard", "durable.raw", "durable.best"} {
		f, err := os.Open(prefix + "." + name + ".prof")
		if err != nil {
			t.Fatal(err)
		}
		p, err := profile.Parse(f)
		f.Close()
		if err != nil || len(p.SampleType) == 0 || p.SampleType[len(p.SampleType)-1].Unit != "nanoseconds" {
			t.Errorf("side profile %s: %v, %v", name, p, err)
		}
	}
	checkDurable(t, res.Durable, 400, 2, 40, 1)
	if c := res.Durable.CoreRatio; c <= 0 || math.IsInf(c, 0) {
		t.Errorf("durable against core: %v", c)
	}
	if res.Config.Delivery != "both" || res.Durable.Type != res.Config.Type+"-durable" {
		t.Errorf("config %+v, durable type %q", res.Config, res.Durable.Type)
	}
	// The new fields, by their JSON names.
	d, _ := raw["durable"].(map[string]any)
	for _, k := range []string{"msgs", "type", "stream", "raw_stream", "best_stream", "best_consumers", "storage", "replicas", "ratio", "same_shape_ratio", "core_ratio", "throughput", "latency"} {
		if _, ok := d[k]; !ok {
			t.Errorf("durable has no %q: %v", k, d)
		}
	}
	dt, _ := d["throughput"].(map[string]any)
	for _, k := range []string{"best_ratio", "best_rounds_ratio", "best_cpu_ratio"} {
		if _, ok := dt[k]; !ok {
			t.Errorf("durable throughput has no %q: %v", k, dt)
		}
	}
	for _, side := range []string{"natshard", "raw", "best"} {
		s, _ := dt[side].(map[string]any)
		for _, k := range []string{"msgs_per_sec", "rounds_msgs_per_sec", "cpu_us_per_msg", "acked", "sent", "received"} {
			if _, ok := s[k]; !ok {
				t.Errorf("durable throughput %s has no %q: %v", side, k, s)
			}
		}
	}
	if _, ok := raw["throughput"].(map[string]any)["natshard"].(map[string]any)["acked"]; ok {
		t.Error("core throughput has acked")
	}
	// Nothing of either type is left on the server.
	nc := natstest.Connect(t, url)
	js := natstest.JetStream(t, nc)
	ctx := context.Background()
	for _, typ := range []string{res.Config.Type, res.Durable.Type} {
		if _, err := js.KeyValue(ctx, kvstate.BucketName(typ)); err == nil {
			t.Errorf("bucket of type %s left on the server", typ)
		}
	}
	left := []string{kvstate.BufferStream(res.Config.Type), kvstate.BufferStream(res.Durable.Type), kvstate.ReminderStream(res.Durable.Type), res.Durable.Raw, res.Durable.Best}
	for i := range res.Durable.Streams {
		left = append(left, strings.TrimSuffix(res.Durable.Raw, "~0")+"~"+strconv.Itoa(i)) // raw JetStream's, as the type's
	}
	for _, name := range append(left, kvstate.AllMessageStreams(res.Durable.Type)...) {
		if _, err := js.Stream(ctx, name); err == nil {
			t.Errorf("stream %s left on the server", name)
		}
	}

	res, raw = benchJSONRaw(t, "bench", "--json", "--delivery", "durable", "--kind", "kv", "--shards", "4", "--entities", "10",
		"--msgs", "200", "--rounds", "1", "--requests", "20")
	checkDurable(t, res.Durable, 200, 1, 20, 1)
	for _, k := range []string{"ratio", "throughput", "latency"} {
		if _, ok := raw[k]; ok {
			t.Errorf("durable delivery alone printed the core field %q", k)
		}
	}
	if res.Durable.CoreRatio != 0 || res.Config.Msgs != 200 || res.Durable.Type != "bench-durable" {
		t.Errorf("durable alone: core ratio %v, config %+v, type %q", res.Durable.CoreRatio, res.Config, res.Durable.Type)
	}
}

// TestBenchCluster: --servers 3 runs the durable bench on three embedded
// servers, the type and the raw streams with three replicas.
func TestBenchCluster(t *testing.T) {
	res := benchJSON(t, "bench", "--json", "--servers", "3", "--delivery", "durable", "--shards", "4", "--entities", "10",
		"--msgs", "200", "--rounds", "1", "--requests", "20")
	checkDurable(t, res.Durable, 200, 1, 20, 3)
	if c := res.Config; c.Servers != 3 || c.Replicas != 3 || c.Server != "embedded, 3 servers" {
		t.Errorf("config %+v", c)
	}
}

// TestBenchKV: kv entities persist each message; the counts hold too.
func TestBenchKV(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	res := benchJSON(t, "--nats", url, "bench", "--json", "--kind", "kv", "--shards", "8", "--entities", "20",
		"--msgs", "400", "--rounds", "1", "--requests", "40")
	checkCounts(t, res, 400, 1, 40)
	if res.Throughput.Natshard.Errors != 0 {
		t.Errorf("%d kv sets failed", res.Throughput.Natshard.Errors)
	}
}

func TestBenchTable(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"bench", "--shards", "4", "--entities", "4", "--msgs", "100", "--rounds", "1", "--requests", "10", "--progress"},
		func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	for _, want := range []string{"NATSHARD", "RAW NATS", "msgs/s (median)", "CPU us/msg", "request p99.9", "req/s, 64 callers"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, stdout.String())
		}
	}
	if !regexp.MustCompile(`received/sent +100/100 +100/100`).MatchString(stdout.String()) {
		t.Errorf("table lacks the counts 100/100 of each side:\n%s", stdout.String())
	}
	if !strings.Contains(stderr.String(), "throughput natshard 1/1") || !strings.Contains(stderr.String(), "\r\033[K") {
		t.Errorf("--progress drew no bar on stderr: %q", stderr.String())
	}
}

func TestBenchTableDurable(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"bench", "--delivery", "durable", "--shards", "4", "--entities", "4", "--msgs", "100", "--rounds", "1", "--requests", "10", "--progress"},
		func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	for _, want := range []string{"durable delivery: 100 msgs per round", "NATSHARD DURABLE", "RAW JETSTREAM, BEST", "RAW JETSTREAM, SAME SHAPE", "1 pull consumers", "100/100", "acked (publish errors)", "100 (0)", "publish to handled p99.9", "messages (errors)"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, stdout.String())
		}
	}
	if strings.Contains(stdout.String(), "RAW NATS") {
		t.Errorf("durable delivery alone printed core's table:\n%s", stdout.String())
	}
	if !strings.Contains(stderr.String(), "throughput raw JetStream (best shape) 1/1") || !strings.Contains(stderr.String(), "throughput raw JetStream (same shape) 1/1") {
		t.Errorf("--progress drew no durable bar on stderr: %q", stderr.String())
	}
}

func TestBenchFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "now"}, "bench takes no arguments"},
		{[]string{"--creds", "x.creds", "bench"}, "bench does not take --creds"},
		{[]string{"bench", "--regions", "0"}, "--regions must be 1..64"},
		{[]string{"bench", "--shards", "0"}, "--shards must be 1.."},
		{[]string{"bench", "--kind", "lua"}, "--kind must be echo or kv"},
		{[]string{"bench", "--shards", "4", "--best-consumers", "5"}, "--best-consumers must be 1..--shards (4), not 5"},
		{[]string{"bench", "--servers", "2"}, "--servers must be 1, 3 or 5, not 2"},
		{[]string{"bench", "--nats", "nats://127.0.0.1:1", "--servers", "3"}, "--servers starts embedded servers: not with --nats"},
		{[]string{"bench", "--replicas", "3"}, "--replicas must be 1..5, and at most --servers (1) with embedded servers, not 3"},
		{[]string{"bench", "--entities", "0"}, "--entities must be at least 1"},
		{[]string{"bench", "--pubs", "4", "--msgs", "3"}, "--msgs (3) must be at least --pubs (4)"},
		{[]string{"bench", "--size", "0"}, "--size must be 1.."},
		{[]string{"bench", "--kind", "kv", "--size", "10"}, "at least 34 with --kind kv"},
		{[]string{"bench", "--rounds", "0"}, "--rounds must be at least 1"},
		{[]string{"bench", "--requests", "-1"}, "--requests must be 0 or more"},
		{[]string{"bench", "--handoff", "--regions", "1"}, "need --regions 2 or more"},
		{[]string{"bench", "--failover", "--kills", "0"}, "--kills must be at least 1"},
		{[]string{"bench", "--rate", "0"}, "--rate must be positive"},
		{[]string{"bench", "--delivery", "jetstream"}, "--delivery must be core, durable or both"},
		{[]string{"bench", "--cpuprofile", "a", "--side-profiles", "b"}, "--cpuprofile and --side-profiles cannot both be given"},
		{[]string{"bench", "--side-profiles", "/nonexistent-natshard-dir/cpu"}, "no directory /nonexistent-natshard-dir to write the profiles in"},
		{[]string{"bench", "--delivery", "durable", "--handoff"}, "--handoff and --failover measure core delivery"},
		{[]string{"bench", "--delivery", "both", "--msgs", "-1"}, "--msgs (-1) must be at least --pubs (2)"},
		{[]string{"bench", "--delivery", "durable", "--type", strings.Repeat("t", 60)}, "longer than 64"},
		{[]string{"--timeout", "0s", "bench"}, "--timeout must be positive"},
		{[]string{"bench", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"bench", "--type", "a b"}, "invalid name"},
	} {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), tc.args, func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
		if err == nil || !strings.Contains(err.Error(), tc.want) || exitCode(err) != 2 {
			t.Errorf("%v: err %v (exit %d), want %q and exit 2", tc.args, err, exitCode(err), tc.want)
		}
	}
	// A type that exists on the server is never touched.
	url := natstest.URL(natstest.RunServer(t))
	nc := natstest.Connect(t, url)
	if _, err := kvstate.Open(context.Background(), natstest.JetStream(t, nc), "mine", kvstate.Options{}); err != nil {
		t.Fatal(err)
	}
	err := run(context.Background(), []string{"bench", "--nats", url, "--type", "mine"}, func(string) string { return "" }, strings.NewReader(""), &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), `type "mine" exists`) || exitCode(err) != 2 {
		t.Errorf("bench on an existing type: %v", err)
	}
	if _, err := natstest.JetStream(t, nc).KeyValue(context.Background(), kvstate.BucketName("mine")); err != nil {
		t.Errorf("the existing type's bucket is gone: %v", err)
	}
}

// BenchmarkEntities is issue 14's curve of the cost per message as the
// entities of the workload grow from 1 000 to 1 000 000: shardctl bench's
// throughput rounds (2 regions, 128 shards, echo entities, messages
// spread uniformly: message i to entity i mod N), each run a whole
// `shardctl bench --entities N --requests 0 --json`, so the ratio to raw
// NATS is of the same run. A round sends max(300 000, N) messages per
// side, so that each round reaches every entity; the first natshard
// round activates them (first-round-msgs/s), the medians of the 5 rounds
// are steady state (entities active and idle). Run with
//
//	go test -run '^$' -bench BenchmarkEntities -benchtime 1x ./cmd/shardctl/
func BenchmarkEntities(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000, 1_000_000} {
		b.Run(fmt.Sprintf("entities=%d", n), func(b *testing.B) {
			msgs := max(300_000, n)
			for range b.N {
				res := benchJSON(b, "bench", "--json", "--entities", strconv.Itoa(n), "--msgs", strconv.Itoa(msgs), "--requests", "0")
				t := res.Throughput
				if want := int64(msgs * 5); t.Natshard.Received != want || t.Raw.Received != want {
					b.Fatalf("received %d (natshard) and %d (raw) of %d", t.Natshard.Received, t.Raw.Received, want)
				}
				b.ReportMetric(t.Natshard.CPUPerMsgUS, "cpu-us/msg")
				b.ReportMetric(t.Raw.CPUPerMsgUS, "raw-cpu-us/msg")
				b.ReportMetric(t.CPURatio, "cpu-ratio")
				b.ReportMetric(t.Ratio, "ratio")
				b.ReportMetric(t.Natshard.MsgsPerSec, "msgs/s")
				b.ReportMetric(t.Natshard.RoundsPerSec[0], "first-round-msgs/s")
				slog.Info("entities curve", "entities", n, "msgs_per_round", msgs,
					"natshard_cpu_us", t.Natshard.CPUPerMsgUS, "raw_cpu_us", t.Raw.CPUPerMsgUS, "cpu_ratio", t.CPURatio,
					"ratio", t.Ratio, "rounds_ratio", t.RoundsRatio, "natshard_rounds", t.Natshard.RoundsPerSec)
			}
		})
	}
}

// TestBenchLoadLatency: --load-latency adds, for each delivery, the rows
// of the latency table at the low rate and at 80 % of the run's maximum
// (for publishes, what the same open loop handled at the throughput
// rounds' rate), with ordered percentiles of every message and request
// sent.
func TestBenchLoadLatency(t *testing.T) {
	res := benchJSON(t, "bench", "--json", "--delivery", "both", "--shards", "4", "--entities", "10", "--msgs", "400", "--rounds", "1",
		"--requests", "20", "--callers", "4", "--load-latency", "--low-rate", "100", "--load-seconds", "0.5")
	if res.Durable == nil {
		t.Fatal("no durable run")
	}
	for name, rows := range map[string][]benchlab.LoadLatency{"core": res.LoadLatency, "durable": res.Durable.LoadLatency} {
		if len(rows) != 2 || rows[0].Load != "low" || rows[0].Rate != 100 || rows[0].ReqRate != 100 || rows[1].Load != "80%" || rows[1].Rate <= 0 || rows[1].ReqRate <= 0 {
			t.Fatalf("%s: rows %+v", name, rows)
		}
		if hi := rows[1]; hi.Max <= 0 || hi.ClosedMax <= 0 || math.Abs(hi.Rate-0.8*hi.Max) > 1e-6*hi.Max || rows[0].Max != 0 {
			t.Errorf("%s: the high load is not 80 %% of the open loop's maximum: %+v", name, rows)
		}
		for _, r := range rows {
			// Every message and request sent (at that rate, or as fast as
			// the bench could) is counted.
			for what, p := range map[string]struct {
				benchlab.LatencyPoint
				rate float64
			}{"handled": {r.Handled, r.Rate}, "request": {r.Request, r.ReqRate}} {
				if d := p.Count - int64(0.5*p.rate); d < -1 || d > 1 || p.Errors != 0 || p.P50US <= 0 || p.P50US > p.P90US || p.P90US > p.P99US || what == "handled" && p.Handled <= 0 {
					t.Errorf("%s %s at %s (%.0f/s): %+v", name, what, r.Load, p.rate, p.LatencyPoint)
				}
			}
		}
	}
}
