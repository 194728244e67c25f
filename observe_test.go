package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// durationCheck is a slog handler that notes every attribute whose value
// is a time.Duration: slog's JSON handler writes those as integer
// nanoseconds, which people cannot read (issue 16), so natshard's lines
// log durations as strings.
type durationCheck struct {
	mu    *sync.Mutex
	found *[]string
	attrs []slog.Attr
}

func newDurationCheck() durationCheck { return durationCheck{mu: &sync.Mutex{}, found: &[]string{}} }

func (d durationCheck) Enabled(context.Context, slog.Level) bool { return true }
func (d durationCheck) WithGroup(string) slog.Handler            { return d }
func (d durationCheck) WithAttrs(as []slog.Attr) slog.Handler {
	d.attrs = append(slices.Clone(d.attrs), as...)
	return d
}

func (d durationCheck) Handle(_ context.Context, r slog.Record) error {
	check := func(a slog.Attr) {
		if a.Value.Resolve().Kind() == slog.KindDuration {
			d.mu.Lock()
			*d.found = append(*d.found, fmt.Sprintf("%q: %s=%v", r.Message, a.Key, a.Value))
			d.mu.Unlock()
		}
	}
	for _, a := range d.attrs {
		check(a)
	}
	r.Attrs(func(a slog.Attr) bool { check(a); return true })
	return nil
}

func (d durationCheck) verify(t *testing.T) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(*d.found) > 0 {
		t.Errorf("log lines with time.Duration values (JSON logs print nanoseconds): %s", strings.Join(*d.found, "; "))
	}
}

// gate holds the Stop hooks of one region's entities until opened, and
// says when one began.
type gate struct {
	entered chan struct{}
	open    chan struct{}
	once    sync.Once
}

// seen is a message as an entity saw it.
type seen struct {
	region, data   string
	trace, spanOf  string // the trace id and span id in Handle's context
	remote, traced bool
}

// traceWorld hosts the type "traced": each entity records the trace
// context of its Handle; the Stop hooks of a gated region wait.
type traceWorld struct {
	mu    sync.Mutex
	seen  []seen
	gates map[string]*gate
}

func (w *traceWorld) factory(region string) natshard.Factory {
	return func(context.Context, string) (natshard.Entity, error) {
		return &traceEntity{w: w, region: region}, nil
	}
}

type traceEntity struct {
	w      *traceWorld
	region string
}

func (e *traceEntity) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	sc := trace.SpanContextFromContext(ctx)
	e.w.mu.Lock()
	e.w.seen = append(e.w.seen, seen{region: e.region, data: string(m.Data), trace: sc.TraceID().String(), spanOf: sc.SpanID().String(), remote: sc.IsRemote(), traced: sc.IsValid()})
	e.w.mu.Unlock()
	return m.Data, nil
}

func (e *traceEntity) Stop(context.Context) error {
	e.w.mu.Lock()
	g := e.w.gates[e.region]
	e.w.mu.Unlock()
	if g != nil {
		g.once.Do(func() { close(g.entered) })
		<-g.open
	}
	return nil
}

func (w *traceWorld) find(data string) (seen, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, s := range w.seen {
		if s.data == data {
			return s, true
		}
	}
	return seen{}, false
}

// TestTraceContinuesAcrossAMove: a message sent with a trace context while
// its shard is paused for a move is buffered by the old owner and
// replayed by the new one; the entity there sees the sender's trace in
// its Handle context, and the node makes the handling's span a child of
// the sender's. The move's steps are spans and histogram observations;
// no log line of the nodes carries a time.Duration.
func TestTraceContinuesAcrossAMove(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	reg := prometheus.NewRegistry()
	logs := newDurationCheck()
	w := &traceWorld{gates: map[string]*gate{}}
	ctx := context.Background()
	start := func(region string) *natshard.Node {
		n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: region, TracerProvider: tp, Metrics: reg, Logger: slog.New(logs)},
			natshard.Type{Name: "traced", Shards: 4, MinRegions: 2, RebalanceInterval: natshard.Off, Entity: w.factory(region)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(ctx) })
		return n
	}
	a, b := start("a"), start("b")
	natstest.Eventually(t, 20*time.Second, "both nodes ready", func() bool { return a.Ready() == nil && b.Ready() == nil })
	natstest.Eventually(t, 20*time.Second, "every shard held", func() bool {
		sa, _ := a.Stats("traced")
		sb, _ := b.Stats("traced")
		return len(sa.Shards)+len(sb.Shards) == 4
	})
	sa, _ := a.Stats("traced")
	if len(sa.Shards) == 0 {
		t.Fatalf("a holds no shard: %+v", sa)
	}
	shard := sa.Shards[0]
	id := ""
	for i := 0; id == ""; i++ {
		if e := fmt.Sprintf("e%d", i); protocol.ShardOf(e, 4) == shard {
			id = e
		}
	}
	nc := natstest.Connect(t, url)
	client := natshard.NewClient(nc)
	if _, err := client.Request(ctx, "traced", id, []byte("before")); err != nil {
		t.Fatal(err)
	}
	if s, _ := w.find("before"); s.region != "a" || s.traced {
		t.Fatalf("first message seen as %+v; want on a, without trace context", s)
	}

	// Hold a's entities in their Stop hook: the shard stays paused, its
	// arrivals going to the buffer.
	g := &gate{entered: make(chan struct{}), open: make(chan struct{})}
	w.mu.Lock()
	w.gates["a"] = g
	w.mu.Unlock()
	m, err := nc.Request(protocol.MustSubjects("", "", "traced").Admin(protocol.AdminMove), fmt.Appendf(nil, `{"shard":%d,"region":"b"}`, shard), 5*time.Second)
	if err != nil || !strings.Contains(string(m.Data), `"ok":true`) {
		t.Fatalf("move: %v %s", err, m.Data)
	}
	select {
	case <-g.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("a never paused the shard")
	}
	sender := sdktrace.NewTracerProvider() // the publisher's own SDK
	sctx, span := sender.Tracer("test").Start(ctx, "publish")
	if err := client.Publish(sctx, "traced", id, []byte("traced")); err != nil {
		t.Fatal(err)
	}
	span.End()
	natstest.Eventually(t, 20*time.Second, "a to buffer the message", func() bool { s, _ := a.Stats("traced"); return s.Buffered >= 1 })
	close(g.open)

	natstest.Eventually(t, 20*time.Second, "the traced message handled", func() bool { _, ok := w.find("traced"); return ok })
	got, _ := w.find("traced")
	want := span.SpanContext()
	if got.region != "b" || got.trace != want.TraceID().String() {
		t.Fatalf("the message sent during the move was handled as %+v; want on b in trace %s", got, want.TraceID())
	}
	if sb, _ := b.Stats("traced"); sb.Replayed < 1 {
		t.Fatalf("b replayed nothing: %+v", sb)
	}
	// The node's span of the handling: a child of the sender's span, in
	// its trace (so Handle's context held the node's span, not the
	// sender's: got.spanOf is the node's span).
	var handle sdktrace.ReadOnlySpan
	natstest.Eventually(t, 20*time.Second, "the handle span", func() bool {
		for _, s := range spans.Ended() {
			if s.Name() == "natshard.handle" && s.SpanContext().TraceID() == want.TraceID() {
				handle = s
				return true
			}
		}
		return false
	})
	if handle.Parent().SpanID() != want.SpanID() || handle.SpanContext().SpanID().String() != got.spanOf || !handle.Parent().IsRemote() {
		t.Fatalf("handle span %s, parent %s (remote %v); want a child of the sender's %s, seen by Handle", handle.SpanContext().SpanID(), handle.Parent().SpanID(), handle.Parent().IsRemote(), want.SpanID())
	}
	if !hasAttr(handle, "natshard.region", "b") {
		t.Fatalf("handle span attributes %v", handle.Attributes())
	}

	// The move's spans: the coordinator's move with its pause and bind,
	// a's stop and b's replay.
	natstest.Eventually(t, 20*time.Second, "the move's spans", func() bool {
		names := map[string]bool{}
		for _, s := range spans.Ended() {
			if hasAttr(s, "natshard.shard", fmt.Sprint(shard)) || names["natshard.move"] && (s.Name() == "natshard.pause" || s.Name() == "natshard.bind") {
				names[s.Name()] = true
			}
		}
		return names["natshard.move"] && names["natshard.pause"] && names["natshard.bind"] && names["natshard.stop"] && names["natshard.replay"]
	})
	// (The first allocation of the shard, parked to a, is a move too.)
	var move sdktrace.ReadOnlySpan
	for _, s := range spans.Ended() {
		if s.Name() == "natshard.move" && hasAttr(s, "natshard.shard", fmt.Sprint(shard)) && hasAttr(s, "natshard.from", "a") {
			move = s
		}
	}
	if move == nil || !hasAttr(move, "natshard.to", "b") || !hasAttr(move, "natshard.outcome", "done") {
		t.Fatalf("no move span of shard %d from a to b, done", shard)
	}
	var children []string
	for _, s := range spans.Ended() {
		if s.Parent().SpanID() == move.SpanContext().SpanID() {
			children = append(children, s.Name())
		}
	}
	if slices.Sort(children); !slices.Equal(children, []string{"natshard.bind", "natshard.pause"}) {
		t.Fatalf("the move span's children %v, want its pause and bind", children)
	}
	// And the histogram: one observation of each step of the move.
	counts := stepCounts(t, reg)
	for _, step := range []string{natshard.StepPause, natshard.StepBind, natshard.StepMove, natshard.StepStop, natshard.StepReplay} {
		if counts[step] < 1 {
			t.Errorf("natshard_handoff_duration_seconds{step=%q} observed %d times; want at least 1 (%v)", step, counts[step], counts)
		}
	}
	if counts[natshard.StepMove] != 1 || counts[natshard.StepPause] != 1 {
		t.Errorf("one move and one pause observed, got %v", counts)
	}
	logs.verify(t)
}

func hasAttr(s sdktrace.ReadOnlySpan, key, value string) bool {
	for _, a := range s.Attributes() {
		if string(a.Key) == key && a.Value.String() == value {
			return true
		}
	}
	return false
}

// stepCounts sums the observations of natshard_handoff_duration_seconds
// by step, over regions.
func stepCounts(t *testing.T, g prometheus.Gatherer) map[string]uint64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() != "natshard_handoff_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "step" {
					out[l.GetValue()] += m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return out
}

// TestReadyWaitsForACoordinator: a node's readiness, Akka's way: not
// before a coordinator took its region in; then ready; a node that stops
// is not ready, nor healthy once stopped. With ReadyAfter, a node is ready
// without a coordinator once that much time has passed.
func TestReadyWaitsForACoordinator(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	ctx := context.Background()
	typ := natshard.Type{Name: "ready", Shards: 4, Entity: newEnvEntity}
	n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "r", NoCoordinator: true, ReadyAfter: natshard.Off, Logger: quiet}, typ)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close(ctx)
	if err := n.Healthy(); err != nil {
		t.Fatalf("Healthy: %v", err)
	}
	err = n.Ready()
	if !errors.Is(err, natshard.ErrNotReady) || !strings.Contains(err.Error(), `type "ready": no coordinator has taken the region in yet`) {
		t.Fatalf("Ready without a coordinator: %v", err)
	}
	c, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "c", NoRegion: true, Logger: quiet}, natshard.Type{Name: "ready"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	natstest.Eventually(t, 20*time.Second, "ready once a coordinator took the region in", func() bool { return n.Ready() == nil })
	// Taken in (a probe answered) may come before the binds: the shards follow.
	natstest.Eventually(t, 20*time.Second, "the region holds the four shards", func() bool { s, _ := n.Stats("ready"); return len(s.Shards) == 4 })
	if err := c.Ready(); err != nil {
		t.Fatalf("a dedicated coordinator: %v", err)
	}
	// The coordinator goes: ready all the same (it was taken in once).
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.Ready(); err != nil {
		t.Fatalf("after the coordinator stopped: %v", err)
	}
	if err := c.Healthy(); !errors.Is(err, natshard.ErrUnhealthy) || !strings.Contains(err.Error(), "the node stopped") {
		t.Fatalf("Healthy of a stopped node: %v", err)
	}
	if err := c.Ready(); !errors.Is(err, natshard.ErrNotReady) {
		t.Fatalf("Ready of a stopped node: %v", err)
	}

	// ReadyAfter: no coordinator comes, ready after it.
	e, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "e", NoCoordinator: true, ReadyAfter: 2 * time.Second, Logger: quiet},
		natshard.Type{Name: "escape", Shards: 4, Entity: newEnvEntity})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	if err := e.Ready(); err == nil || !strings.Contains(err.Error(), "ready anyway 2s after the start") {
		t.Fatalf("Ready at once: %v", err)
	}
	natstest.Eventually(t, 20*time.Second, "ready after ReadyAfter, without a coordinator", func() bool { return e.Ready() == nil })
}

// TestMetricsRegistered: a node's collectors go to Options.Metrics (two
// nodes of one process in one registry stay apart by their region label),
// export only names MetricNames lists, and leave with the node.
func TestMetricsRegistered(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	typ := natshard.Type{Name: "metered", Shards: 4, Entity: newEnvEntity}
	start := func(region string) *natshard.Node {
		n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: region, Metrics: reg, Logger: quiet}, typ)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	a, b := start("a"), start("b")
	if _, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "a", Metrics: reg, Logger: quiet}, natshard.Type{Name: "other", Entity: newEnvEntity}); err == nil || !strings.Contains(err.Error(), "Metrics") {
		t.Fatalf("a second node of region a in the registry: %v", err)
	}
	c := natshard.NewClient(natstest.Connect(t, url))
	for i := range 10 {
		if _, err := c.Request(ctx, "metered", fmt.Sprint("e", i), []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	// An answer is sent before its message counts as handled: gather
	// until the last one does.
	names := natshard.MetricNames()
	var mfs []*dto.MetricFamily
	var handled float64
	var regions map[string]bool
	natstest.Eventually(t, 10*time.Second, "10 messages counted as handled", func() bool {
		var err error
		if mfs, err = reg.Gather(); err != nil {
			t.Fatal(err)
		}
		handled, regions = 0, map[string]bool{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "region" {
						regions[l.GetValue()] = true
					}
				}
				if mf.GetName() == "natshard_messages_handled_total" {
					handled += m.GetCounter().GetValue()
				}
			}
		}
		return handled == 10
	})
	for _, mf := range mfs {
		if !slices.Contains(names, mf.GetName()) {
			t.Errorf("exported %s, which MetricNames does not list", mf.GetName())
		}
	}
	if handled != 10 || !regions["a"] || !regions["b"] {
		t.Fatalf("handled %v (want 10), regions %v", handled, regions)
	}
	if len(mfs) < len(names)-1 { // all but the histogram, which has no observation yet
		got := []string{}
		for _, mf := range mfs {
			got = append(got, mf.GetName())
		}
		t.Errorf("exported %v, want every one of %v", got, names)
	}
	for _, n := range []*natshard.Node{a, b} {
		if err := n.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if mfs, _ := reg.Gather(); len(mfs) != 0 {
		t.Fatalf("after the nodes stopped the registry still has %d families", len(mfs))
	}
	// The registry takes a node of the same region again.
	start("a").Close(ctx)
}
