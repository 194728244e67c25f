package sidecar_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/sidecar"
)

// goEcho is a Go entity that does what echoHandler does: answer the
// payload.
type goEcho struct{}

func (goEcho) Handle(_ context.Context, m *natshard.Message) ([]byte, error) { return m.Data, nil }
func (goEcho) Stop(context.Context) error                                    { return nil }

// echoHandler is the app of the benchmark: it answers a message's payload
// and has no lifecycle callbacks.
func echoHandler(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if len(body) == 0 && r.URL.Path != sidecar.HealthPath {
		http.NotFound(w, r) // /activate, /stop
		return
	}
	w.Write(body)
}

// BenchmarkOverhead measures, in one run and one node, requests through
// the sidecar to an HTTP app that echoes (in this process, in Go) beside
// requests to a Go entity that echoes: the throughput of 64 callers, each
// asking its own entity one request at a time (b.N requests per type),
// and the latency of one caller (b.N/4 requests per type), and reports
// the sidecar's figures as ratios of the Go entity's:
//
//	go test -run '^$' -bench Overhead -benchtime 20000x ./sidecar/
func BenchmarkOverhead(b *testing.B) {
	url := natstest.URL(natstest.RunServer(b))
	app := serve(b, http.HandlerFunc(echoHandler), nil)
	sc, err := sidecar.New(sidecar.Config{App: app.URL, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	node, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "a", Logger: quiet},
		natshard.Type{Name: "go", Shards: 16, Entity: func(context.Context, string) (natshard.Entity, error) { return goEcho{}, nil }},
		sc.Type(natshard.Type{Name: "http", Shards: 16}))
	if err != nil {
		b.Fatal(err)
	}
	sc.Attach(node)
	defer sc.Close()
	defer node.Close(ctx)
	client := natshard.NewClient(natstest.Connect(b, url))
	const callers = 64
	payload := make([]byte, 128)
	for _, typ := range []string{"go", "http"} { // activate every entity first
		for c := range callers {
			if _, err := client.Request(ctx, typ, fmt.Sprintf("e-%d", c), payload); err != nil {
				b.Fatal(err)
			}
		}
	}

	throughput := func(typ string, n int) float64 {
		t0 := time.Now()
		var wg sync.WaitGroup
		for c := range callers {
			wg.Go(func() {
				id := fmt.Sprintf("e-%d", c)
				for i := c; i < n; i += callers {
					if _, err := client.Request(ctx, typ, id, payload); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		return float64(n) / time.Since(t0).Seconds()
	}
	latency := func(typ string, n int) (p50, p99 time.Duration) {
		d := make([]time.Duration, n)
		for i := range d {
			t0 := time.Now()
			if _, err := client.Request(ctx, typ, "e-0", payload); err != nil {
				b.Fatal(err)
			}
			d[i] = time.Since(t0)
		}
		slices.Sort(d)
		return d[n/2], d[n*99/100]
	}

	b.ResetTimer()
	goRate, httpRate := throughput("go", b.N), throughput("http", b.N)
	n := max(b.N/4, 100)
	goP50, goP99 := latency("go", n)
	httpP50, httpP99 := latency("http", n)
	b.StopTimer()

	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	b.ReportMetric(goRate, "go-req/s")
	b.ReportMetric(httpRate, "sidecar-req/s")
	b.ReportMetric(httpRate/goRate, "throughput-ratio")
	b.ReportMetric(us(goP50), "go-p50-us")
	b.ReportMetric(us(httpP50), "sidecar-p50-us")
	b.ReportMetric(float64(httpP50)/float64(goP50), "p50-ratio")
	b.ReportMetric(float64(httpP99)/float64(goP99), "p99-ratio")
	b.Logf("sidecar overhead (%d requests per type): throughput %.0f req/s through the sidecar, %.0f to a Go entity (%.2fx); latency p50 %s / %s (%.2fx), p99 %s / %s (%.2fx)",
		b.N, httpRate, goRate, httpRate/goRate, httpP50.Round(time.Microsecond), goP50.Round(time.Microsecond), float64(httpP50)/float64(goP50),
		httpP99.Round(time.Microsecond), goP99.Round(time.Microsecond), float64(httpP99)/float64(goP99))
}
