package natshard

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/region"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Traces. A message that carries a W3C traceparent header (lowercase:
// nats.go's headers are case-sensitive maps) continues its trace into its
// entity: the factory and Handle get a context holding the remote span
// context, whether or not the node makes spans, so that what the entity
// calls can continue the trace. The header travels with the message
// through the buffer of a move and the new owner's replay, so the trace
// continues there. With Options.TracerProvider, the node also makes a
// span for each such message's handling (none for messages without a
// traceparent: natshard starts no trace of its own per message) and for
// the steps of handoffs. A message without headers costs one nil check.

// Header names of W3C trace context.
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
)

// tracerName is the instrumentation scope of natshard's spans.
const tracerName = "github.com/natshard/natshard"

// w3c propagates W3C trace context (traceparent, tracestate).
var w3c = propagation.TraceContext{}

// HeaderCarrier adapts nats.Header to OpenTelemetry's TextMapCarrier,
// with the header names as given (W3C's are lowercase).
type HeaderCarrier nats.Header

// Get returns the first value of key.
func (c HeaderCarrier) Get(key string) string {
	if v := c[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// Set sets key to value.
func (c HeaderCarrier) Set(key, value string) { c[key] = []string{value} }

// Keys lists the header names.
func (c HeaderCarrier) Keys() []string {
	out := make([]string, 0, len(c))
	for k := range c {
		out = append(out, k)
	}
	return out
}

// traceMessage is the region's Config.Trace: it continues the trace of a
// message with a traceparent header.
func (h *hosted) traceMessage(ctx context.Context, m *nats.Msg) (context.Context, func(error)) {
	if len(m.Header[HeaderTraceparent]) == 0 {
		return ctx, nil
	}
	ctx = w3c.Extract(ctx, HeaderCarrier(m.Header))
	if h.tracer == nil {
		return ctx, nil
	}
	ctx, span := h.tracer.Start(ctx, "natshard.handle", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", m.Subject),
			attribute.String("natshard.type", h.t.Name),
			attribute.String("natshard.region", h.node.opts.Region),
		))
	return ctx, func(err error) {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// regionStep is the region's Config.OnStep: a histogram observation and
// a span for its pause (stop) or replay.
func (h *hosted) regionStep(s region.Step) {
	step := StepStop
	if s.Kind == "replay" {
		step = StepReplay
	}
	h.node.metrics.observe(h.t.Name, step, s.Ended.Sub(s.Began))
	if h.tracer == nil {
		return
	}
	attrs := []attribute.KeyValue{
		attribute.String("natshard.type", h.t.Name), attribute.String("natshard.region", h.node.opts.Region),
		attribute.Int("natshard.shard", s.Shard), attribute.String("natshard.handoff", strconv.FormatUint(s.Handoff, 10)),
	}
	if step == StepReplay {
		attrs = append(attrs, attribute.Int("natshard.replayed", s.Replayed))
	}
	_, span := h.tracer.Start(context.Background(), "natshard."+step, trace.WithTimestamp(s.Began), trace.WithAttributes(attrs...))
	span.End(trace.WithTimestamp(s.Ended))
}

// coordinatorMove is the coordinator's Config.OnMove: histogram
// observations for its steps and, with a tracer, a span for the move with
// a child per step, made with the times the leader noted.
func (h *hosted) coordinatorMove(m coordinator.Move) {
	typ := h.t.Name
	if !m.Paused.IsZero() {
		h.node.metrics.observe(typ, StepPause, m.Paused.Sub(m.Began))
	}
	if m.Done && !m.Bound.IsZero() {
		h.node.metrics.observe(typ, StepBind, m.Ended.Sub(m.Bound))
	}
	if m.Done && m.From != "" {
		h.node.metrics.observe(typ, StepMove, m.Ended.Sub(m.Began))
	}
	if h.tracer == nil {
		return
	}
	outcome := "done"
	if !m.Done {
		outcome = "abandoned"
	}
	ctx, span := h.tracer.Start(context.Background(), "natshard.move", trace.WithTimestamp(m.Began), trace.WithAttributes(
		attribute.String("natshard.type", typ), attribute.Int("natshard.shard", m.Shard),
		attribute.String("natshard.handoff", strconv.FormatUint(m.Handoff, 10)),
		attribute.String("natshard.from", m.From), attribute.String("natshard.to", m.To),
		attribute.String("natshard.outcome", outcome),
	))
	child := func(name string, from, to time.Time) {
		_, s := h.tracer.Start(ctx, name, trace.WithTimestamp(from))
		s.End(trace.WithTimestamp(to))
	}
	if !m.Paused.IsZero() {
		child("natshard.pause", m.Began, m.Paused)
	}
	if !m.Bound.IsZero() {
		child("natshard.bind", m.Bound, m.Ended)
	}
	if !m.Done {
		span.SetStatus(codes.Error, "abandoned: the shard was parked again before it went active")
	}
	span.End(trace.WithTimestamp(m.Ended))
}
