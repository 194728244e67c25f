package natstest_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
)

func TestRunServer(t *testing.T) {
	s := natstest.RunServer(t)
	if !s.JetStreamEnabled() {
		t.Fatal("JetStream not enabled")
	}
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(s)))
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestRunCluster creates an R3 stream and keeps writing to it after its
// leader shut down.
func TestRunCluster(t *testing.T) {
	servers := natstest.RunCluster(t, 3)
	if natstest.MetaLeader(servers) == nil {
		t.Fatal("no meta leader")
	}
	nc := natstest.Connect(t, natstest.ClusterURLs(servers))
	js := natstest.JetStream(t, nc)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Replicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.1", nil); err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range servers {
		if s.Name() == info.Cluster.Leader {
			natstest.Shutdown(s)
		}
	}
	natstest.Eventually(t, 30*time.Second, "a publish after the stream leader "+info.Cluster.Leader+" shut down", func() error {
		// Each attempt has its own short bound: one sent into the dying
		// connection must not use up the whole budget.
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		defer acancel()
		_, err := js.Publish(actx, "s.2", nil)
		return err
	})
}
