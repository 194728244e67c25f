package web_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/web"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

var quiet = slog.New(slog.DiscardHandler)

// echo is an entity that answers its payload.
type echo struct{}

func (echo) Handle(_ context.Context, m *natshard.Message) ([]byte, error) { return m.Data, nil }
func (echo) Stop(context.Context) error                                    { return nil }

func newEcho(context.Context, string) (natshard.Entity, error) { return echo{}, nil }

// get returns the status and body of GET url.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// probe is get for a probe's status, with the body for messages.
func probe(t *testing.T, url string) (bool, string) {
	code, body := get(t, url)
	return code == http.StatusOK, strings.TrimSpace(body)
}

// TestProbes: /readyz is false before the node is registered, true once
// it serves, false while its region is fenced (the NATS server is down:
// the node stops serving at once), and true again once it registered
// anew; /healthz follows the connection; /metrics counts the fence.
func TestProbes(t *testing.T) {
	port := natstest.FreePorts(t, 1)[0]
	store := t.TempDir()
	serverOpts := func() *server.Options {
		o := natstest.DefaultOptions(t)
		o.Port, o.StoreDir = port, store
		return o
	}
	srv := natstest.RunServerWithOptions(t, serverOpts())
	url := natstest.URL(srv)
	reg := prometheus.NewRegistry()
	h := web.New(nil, web.Options{Gatherer: reg, Logger: quiet})
	ts := httptest.NewServer(h)
	defer ts.Close()

	for _, path := range []string{"/readyz", "/healthz"} {
		if ok, body := probe(t, ts.URL+path); ok || !strings.Contains(body, "starting") {
			t.Fatalf("%s before the node started: ok=%v %q", path, ok, body)
		}
	}
	ctx := context.Background()
	node, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "w", Metrics: reg, ReadyAfter: natshard.Off, Logger: quiet},
		natshard.Type{Name: "web", Shards: 4, Entity: newEcho})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close(ctx)
	if ok, _ := probe(t, ts.URL+"/readyz"); ok {
		t.Fatal("ready before SetNode")
	}
	h.SetNode(node)
	natstest.Eventually(t, 30*time.Second, "ready once serving", func() bool { ok, _ := probe(t, ts.URL+"/readyz"); return ok })
	// Ready means taken in by the coordinator (health.go), whose first
	// command may be a probe before the shards' allocation: they follow.
	natstest.Eventually(t, 30*time.Second, "the 4 shards held", func() bool { s, _ := node.Stats("web"); return len(s.Shards) == 4 })
	if ok, body := probe(t, ts.URL+"/healthz"); !ok || body != "ok" {
		t.Fatalf("/healthz: %v %q", ok, body)
	}

	// The server goes: the region fences itself at once.
	natstest.Shutdown(srv)
	var why string
	natstest.Eventually(t, 30*time.Second, "not ready while fenced", func() bool { ok, body := probe(t, ts.URL+"/readyz"); why = body; return !ok })
	if !strings.Contains(why, "not connected to NATS") {
		t.Errorf("/readyz while the server is down: %q", why)
	}
	natstest.Eventually(t, 30*time.Second, "the region fenced", func() bool { s, _ := node.Stats("web"); return s.Fenced >= 1 && len(s.Shards) == 0 })
	if ok, body := probe(t, ts.URL+"/healthz"); ok || !strings.Contains(body, "not connected") {
		t.Errorf("/healthz while the server is down: %v %q", ok, body)
	}
	// It comes back on the same port and store: the region registers a
	// new incarnation and is ready again.
	natstest.RunServerWithOptions(t, serverOpts())
	natstest.Eventually(t, 30*time.Second, "ready again", func() bool { ok, _ := probe(t, ts.URL+"/readyz"); return ok })

	code, body := get(t, ts.URL+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	parser := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	fenced := fams["natshard_region_fenced_total"]
	if fenced == nil || len(fenced.GetMetric()) != 1 || fenced.GetMetric()[0].GetCounter().GetValue() < 1 {
		t.Fatalf("natshard_region_fenced_total: %v", fenced)
	}
	labels := model.LabelSet{}
	for _, l := range fenced.GetMetric()[0].GetLabel() {
		labels[model.LabelName(l.GetName())] = model.LabelValue(l.GetValue())
	}
	if labels["type"] != "web" || labels["region"] != "w" {
		t.Fatalf("labels %v", labels)
	}
}
