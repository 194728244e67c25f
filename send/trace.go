package send

import (
	"context"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// HeaderTraceparent is the W3C trace context header a message carries
// when the context of its call holds a span.
const HeaderTraceparent = "traceparent"

// w3c propagates W3C trace context (traceparent, tracestate).
var w3c = propagation.TraceContext{}

// headerCarrier adapts nats.Header to OpenTelemetry's TextMapCarrier.
type headerCarrier nats.Header

func (c headerCarrier) Get(key string) string {
	if v := nats.Header(c)[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

func (c headerCarrier) Set(key, value string) { nats.Header(c)[key] = []string{value} }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// injectTrace puts the span context of ctx, if any, in m's headers as W3C
// trace context, unless m carries a traceparent already.
func injectTrace(ctx context.Context, m *nats.Msg) {
	if !trace.SpanContextFromContext(ctx).IsValid() || len(m.Header[HeaderTraceparent]) > 0 {
		return
	}
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	w3c.Inject(ctx, headerCarrier(m.Header))
}
