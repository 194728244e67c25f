package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

func TestHTTP(t *testing.T) {
	code := http.StatusOK
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(code)
		w.Write([]byte(`{"status":"unavailable","error":"JetStream has not established contact with a meta leader"}`))
	}))
	defer srv.Close()
	if err := check(srv.URL+"/healthz", nil); err != nil {
		t.Errorf("200: %v", err)
	}
	code = http.StatusServiceUnavailable
	if err := check(srv.URL+"/healthz", nil); err == nil || !strings.Contains(err.Error(), "meta leader") {
		t.Errorf("503: %v, want the body in the error", err)
	}
	srv.Close()
	if err := check(srv.URL+"/healthz", nil); err == nil {
		t.Error("closed server: healthy")
	}
}

func TestRegion(t *testing.T) {
	s := natstest.RunServer(t)
	env := map[string]string{"NATS_URL": natstest.URL(s), "NATSHARD_REGION": "a"}
	getenv := func(k string) string { return env[k] }
	if err := check("region", getenv); err == nil || !strings.Contains(err.Error(), "no responders") {
		t.Errorf("no region: %v, want no responders", err)
	}
	// A stand-in for region a's query subject (the region's own answer is
	// tested in the region package): a healthy answer, then an error.
	nc := natstest.Connect(t, natstest.URL(s))
	answer := protocol.QueryAnswer{Region: "a", Incarnation: "i1", Shards: []protocol.ShardReport{}}
	if _, err := nc.Subscribe(protocol.MustSubjects("", "", "kv").Query("a"), func(m *nats.Msg) {
		data, _ := json.Marshal(answer)
		if answer.Region == "" {
			data, _ = json.Marshal(protocol.AdminError{Error: "bad request"})
		}
		m.Respond(data)
	}); err != nil {
		t.Fatal(err)
	}
	nc.Flush()
	if err := check("region", getenv); err != nil {
		t.Errorf("answering region: %v", err)
	}
	answer.Region = ""
	if err := check("region", getenv); err == nil || !strings.Contains(err.Error(), "bad request") {
		t.Errorf("error answer: %v", err)
	}
	env["NATSHARD_REGION"] = ""
	if err := check("region", getenv); err == nil {
		t.Error("no NATSHARD_REGION: healthy")
	}
	if err := check("nats://x", getenv); err == nil {
		t.Error("unknown check: healthy")
	}
}
