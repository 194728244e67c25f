package natshard

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// BenchmarkTraceMessage: what the region's trace hook costs per message
// (the host calls it only for a message with headers): a message with
// headers but no traceparent, one with a traceparent and no tracer (the
// trace context is continued, no span), and one with a recording SDK
// tracer (a span per message, exported nowhere). Run with
//
//	go test -run '^$' -bench BenchmarkTraceMessage -benchmem .
func BenchmarkTraceMessage(b *testing.B) {
	tp := sdktrace.NewTracerProvider() // records, exports nowhere
	defer tp.Shutdown(context.Background())
	node := &Node{}
	for _, bc := range []struct {
		name   string
		header nats.Header
		traced bool
	}{
		{"msgid-only", nats.Header{"Nats-Msg-Id": {"x"}}, false},
		{"traceparent/no-tracer", nats.Header{"Nats-Msg-Id": {"x"}, HeaderTraceparent: {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}, false},
		{"traceparent/sdk-tracer", nats.Header{"Nats-Msg-Id": {"x"}, HeaderTraceparent: {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			h := &hosted{t: Type{Name: "bench"}, node: node}
			if bc.traced {
				h.tracer = tp.Tracer(tracerName)
			}
			m := &nats.Msg{Subject: "shard.bench.1.e", Header: bc.header}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				_, end := h.traceMessage(ctx, m)
				if end != nil {
					end(nil)
				}
			}
		})
	}
}
