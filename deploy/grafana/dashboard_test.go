// Package grafana holds natshard's Grafana dashboard (natshard.json) and
// its provisioning for docker-compose.yml; this test keeps the dashboard
// true to the metrics natshard exports.
package grafana_test

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/natshard/natshard"
)

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // of a collapsed row
}

type dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string `json:"name"`
			Type       string `json:"type"`
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

// metricName finds the names in a PromQL expression that look like
// natshard's metrics.
var metricName = regexp.MustCompile(`\bnatshard_[a-z0-9_]+`)

// TestDashboardQueriesExportedMetrics: every metric the dashboard queries
// is one natshard exports (a histogram by its _bucket, _sum or _count
// series), and every metric natshard exports has a panel; every panel asks
// the dashboard's data source variable, and ids are unique.
func TestDashboardQueriesExportedMetrics(t *testing.T) {
	data, err := os.ReadFile("natshard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(data)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("natshard.json: %v", err)
	}
	if d.UID == "" || d.Title == "" {
		t.Fatalf("uid %q, title %q", d.UID, d.Title)
	}
	exported := natshard.MetricNames()
	used := map[string]bool{}
	ids := map[int]string{}
	var exprs []string
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if prev, ok := ids[p.ID]; ok {
				t.Errorf("panels %q and %q share id %d", prev, p.Title, p.ID)
			}
			ids[p.ID] = p.Title
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q does not ask the data source variable", p.Title)
			}
			if len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, tg := range p.Targets {
				exprs = append(exprs, tg.Expr)
			}
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Definition != "" {
			exprs = append(exprs, v.Definition)
		}
	}
	for _, e := range exprs {
		names := metricName.FindAllString(e, -1)
		if len(names) == 0 {
			t.Errorf("query %q asks no natshard metric", e)
		}
		for _, n := range names {
			base := n
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(n, suffix); ok && slices.Contains(exported, b) {
					base = b
				}
			}
			if !slices.Contains(exported, base) {
				t.Errorf("query %q asks %s, which natshard does not export (natshard.MetricNames)", e, n)
			}
			used[base] = true
		}
	}
	for _, n := range exported {
		if !used[n] {
			t.Errorf("natshard exports %s, which no panel shows", n)
		}
	}
}
