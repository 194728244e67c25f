package bench

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/protocol"
)

// handoffShard is the shard BenchmarkHandoff moves back and forth.
const handoffShard = 42

// BenchmarkHandoff measures the handoff target (docs/BENCHMARKS.md,
// "Targets"): shard X, with K active entities and a steady publisher sending
// to them, moves between regions a and b by explicit admin moves (rebalancing
// is disabled). One sample is the time from sending the move request (the
// decision) to the new owner's first Handle of a message of X. Before each
// move every entity of X is made active on the owner again (timer stopped).
//
// Reported: p50-ms, p99-ms and max-ms of the samples (at least
// -natshard.min-samples of them, whatever b.N; nearest rank, so with fewer
// than 100 samples p99 is the largest), delay-p50-ms (the median over the
// moves of the longest publish-to-Handle delay of a message of X during
// the move), the medians of the steps (see summarize), and ns/op, the time
// of a whole move from the decision until the shard is recorded active
// and every message published until then was handled (it includes the
// source's release grace: none by default, see -natshard.grace). -benchtime 100x makes 100 moves;
// -natshard.report=FILE appends the whole timeline and each move's
// figures to FILE.
//
// Entity counts go from 10 to 100 000 (issue 14's curve); the 100 000
// row spends about 10 s per move making the entities active again (timer
// stopped), so run it alone with fewer moves:
//
//	go test -run '^$' -bench 'BenchmarkHandoff/entities=100000$' -benchtime 20x ./bench/
func BenchmarkHandoff(b *testing.B) {
	for _, k := range []int{10, 100, 1000, 10000, 100000} {
		b.Run(fmt.Sprintf("entities=%d", k), func(b *testing.B) {
			r := newHandoffRun(b, handoffConfig{shard: handoffShard, entities: k, rate: *flagRate})
			var samples []handoffSample
			for b.Loop() {
				b.StopTimer()
				r.prepare()
				b.StartTimer()
				samples = append(samples, r.moveOnce())
			}
			for len(samples) < *flagMinSamples {
				r.prepare()
				samples = append(samples, r.moveOnce())
			}
			s := summarize(samples)
			b.ReportMetric(benchlab.Millis(s.total.p50), "p50-ms")
			b.ReportMetric(benchlab.Millis(s.total.p99), "p99-ms")
			b.ReportMetric(benchlab.Millis(s.total.max), "max-ms")
			b.ReportMetric(benchlab.Millis(s.delay.p50), s.delay.metric)
			for _, st := range s.steps {
				if st.metric != "" {
					b.ReportMetric(benchlab.Millis(st.p50), st.metric)
				}
			}
			b.Log(strings.TrimSuffix(r.describe(s, false), "\n"))
			report(r.describe(s, true))
		})
	}
}

type handoffConfig struct {
	shard    int
	entities int
	rate     float64 // of the background publisher, messages/s
}

// unknown is a time the tracer did not see.
const unknown time.Duration = -1 << 62

// handoffSample is one move. Every field but the counters is a time
// since the move request was sent, or unknown. Times of protocol messages
// are when the tracer (an observer on a connection of its own) received
// them; the others are taken in the regions' processes.
type handoffSample struct {
	total    time.Duration // the new owner handled its first message of the shard
	answered time.Duration // the admin API answered the move request
	written  time.Duration // table row "handoff" written (fenced KV write)
	handoff  time.Duration // HandOff command seen on the source's subject
	stopped  time.Duration // the last Stop hook of the source's entities ran
	paused   time.Duration // the source answered HandOff complete
	binding  time.Duration // table row "binding" written
	bind     time.Duration // Bind command seen on the target's subject
	bound    time.Duration // the target answered Bind
	release  time.Duration // Release command seen on the source's subject
	released time.Duration // the source answered Release (grace, drain, end marker)
	marker   time.Duration // end marker appended to the buffer
	active   time.Duration // table row "active" written

	// delay is the longest a publisher message of the shard took from
	// publication to its Handle (in either region), over the messages
	// handled from the decision until every message published before the
	// row active was handled.
	delay time.Duration

	incomplete int    // HandOff answers with Complete=false before the complete one
	stops      int64  // Stop hooks run on the source
	buffered   uint64 // messages the source diverted to the buffer
	replayed   uint64 // buffered messages the target replayed
}

type handoffRun struct {
	sys    *system
	cfg    handoffConfig
	ids    []string
	client *nats.Conn // requests that activate the entities
	pub    *publisher
}

func newHandoffRun(tb testing.TB, cfg handoffConfig) *handoffRun {
	tb.Helper()
	sys := startSystem(tb, sysConfig{regions: []string{"a", "b"}, minRegions: 2, rebalance: -1})
	r := &handoffRun{sys: sys, cfg: cfg, ids: idsOfShard(cfg.shard, cfg.entities), client: sys.connect("client")}
	if err := sys.touch(r.client, r.ids); err != nil {
		tb.Fatal(err)
	}
	subjects := make([]string, len(r.ids))
	for i, id := range r.ids {
		subjects[i] = sys.subjects.EntityOf(id, shardCount)
	}
	// A window of half a second of messages: enough that a handoff never
	// stalls the publisher, small enough that a stuck system does not
	// pile up messages.
	r.pub = startPublisher(sys.connect("publisher"), subjects, cfg.rate, max(100, int64(cfg.rate/2)), sys.handled)
	sys.onClose(r.pub.close)
	return r
}

// prepare makes every entity of the shard active on its owner, then lets
// the steady load run alone for a moment.
func (r *handoffRun) prepare() {
	tb := r.sys.tb
	tb.Helper()
	owner := r.sys.owner(r.cfg.shard)
	if owner == "" {
		tb.Fatalf("shard %d is not active", r.cfg.shard)
	}
	if err := r.sys.touch(r.client, r.ids); err != nil {
		tb.Fatal(err)
	}
	region := r.sys.region(owner)
	deadline := time.Now().Add(10 * time.Second)
	for region.stats().Entities < r.cfg.entities {
		if time.Now().After(deadline) {
			tb.Fatalf("region %s holds %d entities, want %d", owner, region.stats().Entities, r.cfg.entities)
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
}

// moveOnce moves the shard to the other region and measures.
func (r *handoffRun) moveOnce() handoffSample {
	tb := r.sys.tb
	tb.Helper()
	sh := r.cfg.shard
	from := r.sys.owner(sh)
	to := map[string]string{"a": "b", "b": "a"}[from]
	src, dst := r.sys.region(from), r.sys.region(to)
	first := dst.probe.arm(sh)
	src.probe.arm(-1) // never fires: resets the Stop counters
	buffered0, replayed0 := src.stats().Buffered, dst.stats().Replayed

	t0 := now()
	if err := r.sys.move(sh, to); err != nil {
		tb.Fatalf("move shard %d to %s: %v", sh, to, err)
	}
	answered := now() - t0
	select {
	case <-first:
	case <-time.After(30 * time.Second):
		tb.Fatalf("region %s handled no message of shard %d within 30s of the move", to, sh)
	}
	s := handoffSample{total: time.Duration(dst.probe.first.Load()) - t0, answered: answered}
	isActive := func(e *event) bool {
		return e.kind == evWrite && e.about(sh) && e.state == protocol.StateActive && e.region == to
	}
	deadline := time.Now().Add(30 * time.Second)
	for r.sys.tracer.first(t0, isActive) < 0 {
		if time.Now().After(deadline) {
			tb.Fatalf("shard %d not recorded active on %s within 30s of the move", sh, to)
		}
		time.Sleep(2 * time.Millisecond)
	}
	// The target may still hold messages that reached it after the
	// source unsubscribed: it delivers them once it has replayed the
	// buffer up to the end marker, which can be after the row is written.
	// Wait until every message published so far was handled, so that
	// their delays count.
	sent := r.pub.sent.Load()
	for r.sys.handled() < sent {
		if time.Now().After(deadline) {
			tb.Fatalf("%d messages published before the shard was active are not handled 30s after the move", sent-r.sys.handled())
		}
		time.Sleep(time.Millisecond)
	}
	src.probe.disarm()
	s.delay = time.Duration(max(src.probe.maxDelay.Load(), dst.probe.maxDelay.Load()))
	s.stops = src.probe.stops.Load()
	if last := time.Duration(src.probe.lastStop.Load()); last > 0 {
		s.stopped = last - t0
	} else {
		s.stopped = unknown
	}
	s.buffered = src.stats().Buffered - buffered0
	s.replayed = dst.stats().Replayed - replayed0

	t := r.sys.tracer
	at := func(match func(e *event) bool) time.Duration {
		if v := t.first(t0, match); v >= 0 {
			return v - t0
		}
		return unknown
	}
	write := func(state protocol.ShardState) func(e *event) bool {
		return func(e *event) bool { return e.kind == evWrite && e.about(sh) && e.state == state }
	}
	msg := func(kind eventKind, cmd protocol.CommandKind, region string) func(e *event) bool {
		return func(e *event) bool {
			return e.kind == kind && e.cmd == cmd && e.region == region && e.about(sh) && e.failed == ""
		}
	}
	s.written = at(write(protocol.StateHandoff))
	s.handoff = at(msg(evCommand, protocol.CmdHandOff, from))
	s.paused = at(func(e *event) bool { return msg(evReply, protocol.CmdHandOff, from)(e) && e.complete })
	s.binding = at(write(protocol.StateBinding))
	s.bind = at(msg(evCommand, protocol.CmdBind, to))
	s.bound = at(msg(evReply, protocol.CmdBind, to))
	s.release = at(msg(evCommand, protocol.CmdRelease, from))
	s.released = at(msg(evReply, protocol.CmdRelease, from))
	s.marker = at(func(e *event) bool { return e.kind == evMarker && e.about(sh) })
	s.active = at(isActive)
	for _, e := range t.since(t0) {
		if e.kind == evReply && e.cmd == protocol.CmdHandOff && e.about(sh) && !e.complete && (s.paused < 0 || e.at-t0 < s.paused) {
			s.incomplete++
		}
	}
	return s
}

// stat is the distribution of one step over the samples.
type stat struct {
	name, metric       string
	n                  int
	p50, p90, p99, max time.Duration
}

type handoffSummary struct {
	n          int
	total      stat
	delay      stat
	steps      []stat // durations of the steps, in protocol order
	marks      []stat // times since the decision
	incomplete int
	stops      int64
	buffered   uint64
	replayed   uint64
	samples    []handoffSample
}

func distribution(name, metric string, vals []time.Duration) stat {
	vals = slices.DeleteFunc(slices.Clone(vals), func(d time.Duration) bool { return d == unknown })
	slices.Sort(vals)
	st := stat{name: name, metric: metric, n: len(vals)}
	if len(vals) > 0 {
		st.p50, st.p90, st.p99, st.max = benchlab.Percentile(vals, 0.5), benchlab.Percentile(vals, 0.9), benchlab.Percentile(vals, 0.99), vals[len(vals)-1]
	}
	return st
}

func summarize(samples []handoffSample) handoffSummary {
	sum := handoffSummary{n: len(samples), samples: samples}
	col := func(f func(s handoffSample) time.Duration) []time.Duration {
		out := make([]time.Duration, len(samples))
		for i, s := range samples {
			out[i] = f(s)
		}
		return out
	}
	// diff is b - a, or unknown when either is.
	diff := func(a, b func(s handoffSample) time.Duration) []time.Duration {
		return col(func(s handoffSample) time.Duration { return orUnknown(b(s), a(s)) })
	}
	type getter = func(s handoffSample) time.Duration
	zero := getter(func(handoffSample) time.Duration { return 0 })
	total := getter(func(s handoffSample) time.Duration { return s.total })
	written := getter(func(s handoffSample) time.Duration { return s.written })
	handoff := getter(func(s handoffSample) time.Duration { return s.handoff })
	paused := getter(func(s handoffSample) time.Duration { return s.paused })
	bind := getter(func(s handoffSample) time.Duration { return s.bind })
	bound := getter(func(s handoffSample) time.Duration { return s.bound })
	active := getter(func(s handoffSample) time.Duration { return s.active })

	sum.total = distribution("decision -> first message handled by the new owner", "", col(total))
	sum.delay = distribution("longest publish -> Handle delay of a message during the move", "delay-p50-ms", col(func(s handoffSample) time.Duration { return s.delay }))
	sum.steps = []stat{
		distribution("1 decide: move request -> HandOff sent (admin, fenced KV write)", "decide-p50-ms", diff(zero, handoff)),
		distribution("2 pause+stop: HandOff sent -> source answers complete", "stop-p50-ms", diff(handoff, paused)),
		distribution("3 choose: HandOff answered -> Bind sent (fenced KV write)", "choose-p50-ms", diff(paused, bind)),
		distribution("4 bind: Bind sent -> target answers (subscribe, flush)", "bind-p50-ms", diff(bind, bound)),
		distribution("5 replay start: Bind sent -> first message handled", "replay-p50-ms", diff(bind, total)),
		distribution("6 release: Bind answered -> shard active (grace, drain, marker)", "", diff(bound, active)),
	}
	mark := func(name string, get func(s handoffSample) time.Duration) stat {
		return distribution(name, "", col(get))
	}
	sum.marks = []stat{
		mark("admin answered", func(s handoffSample) time.Duration { return s.answered }),
		mark("row handoff written", written),
		mark("HandOff sent", handoff),
		mark("last entity Stop ran", func(s handoffSample) time.Duration { return s.stopped }),
		mark("HandOff answered complete", paused),
		mark("row binding written", func(s handoffSample) time.Duration { return s.binding }),
		mark("Bind sent", bind),
		mark("Bind answered", bound),
		mark("first message handled by the target", total),
		mark("Release sent", func(s handoffSample) time.Duration { return s.release }),
		mark("end marker appended", func(s handoffSample) time.Duration { return s.marker }),
		mark("Release answered", func(s handoffSample) time.Duration { return s.released }),
		mark("row active written", active),
	}
	for _, s := range samples {
		sum.incomplete += s.incomplete
		sum.stops += s.stops
		sum.buffered += s.buffered
		sum.replayed += s.replayed
	}
	return sum
}

// describe tells the figures of the summary; the short form fits the 10
// lines a benchmark's log is cut to.
func (r *handoffRun) describe(s handoffSummary, full bool) string {
	var b strings.Builder
	n := uint64(max(s.n, 1))
	fmt.Fprintf(&b, "shard %d, %d active entities, publisher %.0f msg/s (window full %d ms), %d moves; per move %d Stop hooks, %d messages buffered, %d replayed; %d HandOff answers incomplete\n",
		r.cfg.shard, r.cfg.entities, r.cfg.rate, r.pub.stalled.Load(), s.n, s.stops/int64(n), s.buffered/n, s.replayed/n, s.incomplete)
	row := func(st stat) {
		fmt.Fprintf(&b, "  %-66s %8.1f %8.1f %8.1f %8.1f  (n=%d)\n", st.name, benchlab.Millis(st.p50), benchlab.Millis(st.p90), benchlab.Millis(st.p99), benchlab.Millis(st.max), st.n)
	}
	fmt.Fprintf(&b, "  %-66s %8s %8s %8s %8s\n", "ms", "p50", "p90", "p99", "max")
	row(s.total)
	row(s.delay)
	for _, st := range s.steps {
		row(st)
	}
	if full {
		b.WriteString("  timeline since the decision:\n")
		for _, st := range s.marks {
			row(st)
		}
		b.WriteString("  each move, ms: first message handled / pause+stop / release (Release sent -> answered) / longest message delay\n   ")
		for i, m := range s.samples {
			fmt.Fprintf(&b, " %.0f/%.0f/%.0f/%.0f", benchlab.Millis(m.total), benchlab.Millis(orUnknown(m.paused, m.handoff)), benchlab.Millis(orUnknown(m.released, m.release)), benchlab.Millis(m.delay))
			if i%10 == 9 && i+1 < len(s.samples) {
				b.WriteString("\n   ")
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// orUnknown is b - a, or unknown when either is.
func orUnknown(b, a time.Duration) time.Duration {
	if a == unknown || b == unknown {
		return unknown
	}
	return b - a
}
