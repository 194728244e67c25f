package web_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/web"
)

// TestProbesWhileStartWaits: while Start waits for JetStream (a cluster
// of three with one server up has no meta leader), /readyz says what it
// waits for and /healthz that the process is alive; once the cluster has
// its majority, Start returns and the node becomes ready.
func TestProbesWhileStartWaits(t *testing.T) {
	opts := natstest.ClusterOptions(t, 3)
	servers := []*server.Server{natstest.RunServerWithOptions(t, opts[0])}
	h := web.New(nil, web.Options{Logger: quiet})
	ts := httptest.NewServer(h)
	defer ts.Close()
	type started struct {
		node *natshard.Node
		err  error
	}
	ch := make(chan started, 1)
	go func() {
		n, err := natshard.Start(context.Background(), natshard.Options{
			NATS: natstest.URL(servers[0]), Region: "w", ReadyAfter: natshard.Off, Logger: quiet,
			StartTimeout: 10 * time.Minute, OnStartWait: h.SetStartWait,
		}, natshard.Type{Name: "web", Shards: 4, Replicas: 3, Entity: newEcho})
		ch <- started{n, err}
	}()
	// The first attempt fails when its own timeout passes: wait generously.
	natstest.Eventually(t, 2*time.Minute, "/readyz to say that the start waits for the KV bucket", func() error {
		ok, body := probe(t, ts.URL+"/readyz")
		if !ok && strings.Contains(body, "starting: type \"web\": waiting") && strings.Contains(body, "for its KV bucket natshard_web") {
			return nil
		}
		return fmt.Errorf("ok=%v %q", ok, body)
	})
	if ok, body := probe(t, ts.URL+"/healthz"); !ok || !strings.Contains(body, "waiting") {
		t.Fatalf("/healthz while the start waits: ok=%v %q", ok, body)
	}
	for _, o := range opts[1:] {
		servers = append(servers, natstest.RunServerWithOptions(t, o))
	}
	var s started
	select {
	case s = <-ch:
	case <-time.After(3 * time.Minute):
		t.Fatal("Start did not return once the cluster had its majority")
	}
	if s.err != nil {
		t.Fatal(s.err)
	}
	defer s.node.Close(context.Background())
	if ok, body := probe(t, ts.URL+"/readyz"); ok || strings.Contains(body, "waiting") {
		t.Fatalf("/readyz before SetNode, once the wait is over: ok=%v %q", ok, body)
	}
	h.SetNode(s.node)
	natstest.Eventually(t, 30*time.Second, "ready once serving", func() bool { ok, _ := probe(t, ts.URL+"/readyz"); return ok })
}
