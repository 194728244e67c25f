package otelenv

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// clearEnv unsets the variables FromEnv reads, for this test.
func clearEnv(t *testing.T) {
	for _, k := range []string{"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"} {
		t.Setenv(k, "")
	}
}

// TestOffUnlessAsked: no variable, or variables that turn it off, give no
// provider; unsupported exporters and protocols are refused by name.
func TestOffUnlessAsked(t *testing.T) {
	for _, tc := range []struct {
		env     map[string]string
		wantErr string
	}{
		{nil, ""},
		{map[string]string{"OTEL_SERVICE_NAME": "x"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"}, ""},
		{map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"},
	} {
		clearEnv(t)
		for k, v := range tc.env {
			t.Setenv(k, v)
		}
		s, err := FromEnv(context.Background(), "test", "r")
		switch {
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%v: err %v, want one naming %s", tc.env, err, tc.wantErr)
		case tc.wantErr == "" && err != nil:
			t.Errorf("%v: %v", tc.env, err)
		case s.Provider != nil:
			t.Errorf("%v: tracing is on", tc.env)
		}
		if err := s.Shutdown(context.Background()); err != nil {
			t.Errorf("%v: Shutdown: %v", tc.env, err)
		}
	}
}

// TestExportsOverOTLPHTTP: with an endpoint, spans go to it as OTLP over
// HTTP, with the service name and instance as resource.
func TestExportsOverOTLPHTTP(t *testing.T) {
	var (
		mu   sync.Mutex
		got  []string
		body []byte
	)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type"))
		body = append(body, b...)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer collector.Close()
	clearEnv(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
	s, err := FromEnv(context.Background(), "shardd", "region-a")
	if err != nil || s.Provider == nil {
		t.Fatalf("FromEnv: %v, provider %v", err, s.Provider)
	}
	_, span := s.Provider.Tracer("test").Start(context.Background(), "natshard.test-span")
	span.End()
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) == 0 || got[0] != "POST /v1/traces application/x-protobuf" {
		t.Fatalf("the collector got %q", got)
	}
	for _, want := range []string{"natshard.test-span", "shardd", "region-a"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("the export lacks %q", want)
		}
	}
}
