// Package otelenv sets up OpenTelemetry tracing for natshard's commands
// from the standard OTEL_* environment variables: an OTLP exporter over
// HTTP (protobuf), batched, with the SDK's own reading of the endpoint,
// headers, TLS, compression, timeout, sampler (OTEL_TRACES_SAMPLER) and
// resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) variables.
//
// One deliberate difference from the SDK's defaults: with no OTEL_*
// variable set, there is no exporter at all (the specification's default
// exporter is otlp to localhost:4318), so that a process nobody asked to
// trace makes no span and sends nothing. Tracing is on when
// OTEL_TRACES_EXPORTER is otlp, or when OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set; OTEL_SDK_DISABLED=true or
// OTEL_TRACES_EXPORTER=none turn it off. Only the http/protobuf protocol is
// built in (the collector's port 4318): grpc would add gRPC to every
// binary.
package otelenv

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Setup is the tracing a process got from its environment.
type Setup struct {
	// Provider makes the spans; nil when tracing is off.
	Provider trace.TracerProvider
	// Endpoint says where spans go, for the log ("" when off).
	Endpoint string
	// Shutdown flushes the spans and stops the exporter; it does nothing
	// when tracing is off.
	Shutdown func(context.Context) error
}

// FromEnv reads the process's environment and returns its tracing, for
// service (the default of service.name) and instance (service.instance.id,
// natshard's region id). An error names the variable at fault.
func FromEnv(ctx context.Context, service, instance string) (Setup, error) {
	off := Setup{Shutdown: func(context.Context) error { return nil }}
	env := func(k string) string { return strings.TrimSpace(os.Getenv(k)) }
	if strings.EqualFold(env("OTEL_SDK_DISABLED"), "true") {
		return off, nil
	}
	endpoint := env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if endpoint == "" {
		endpoint = env("OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	switch exporter := env("OTEL_TRACES_EXPORTER"); exporter {
	case "none":
		return off, nil
	case "":
		if endpoint == "" {
			return off, nil
		}
	case "otlp":
		if endpoint == "" {
			endpoint = "http://localhost:4318 (the default)"
		}
	default:
		return off, fmt.Errorf("OTEL_TRACES_EXPORTER: %q is not supported (otlp or none)", exporter)
	}
	protocol := env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = env("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if protocol != "" && protocol != "http/protobuf" {
		return off, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL: %q is not supported: natshard exports OTLP over http/protobuf (a collector's port 4318)", protocol)
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return off, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	attrs := []attribute.KeyValue{attribute.String("service.name", service)}
	if instance != "" {
		attrs = append(attrs, attribute.String("service.instance.id", instance))
	}
	// Later detectors win: the environment's service name over ours.
	res, err := resource.New(ctx, resource.WithAttributes(attrs...), resource.WithTelemetrySDK(), resource.WithFromEnv())
	if err != nil {
		return off, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return Setup{Provider: tp, Endpoint: endpoint, Shutdown: tp.Shutdown}, nil
}
