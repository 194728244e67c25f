package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
)

// TestEmbeddedCluster: three nodes whose embedded servers form one NATS
// cluster (ServerOptions.Cluster and Routes), started at once: each comes
// up, the type gets three replicas and the cluster's lease TTL, each
// server keeps its name in its data directory, and a client of one member
// reaches the type after that member stopped (its connection discovered
// the others); the last member alone is not ready, for want of a
// JetStream majority.
func TestEmbeddedCluster(t *testing.T) {
	ports := natstest.FreePorts(t, 6)
	var routes []string
	for i := range 3 {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", ports[3+i]))
	}
	opts := func(i int, dir string) natshard.Options {
		return natshard.Options{
			Server: natshard.ServerOptions{
				Listen: fmt.Sprintf("127.0.0.1:%d", ports[i]), DataDir: dir,
				Cluster: fmt.Sprintf("127.0.0.1:%d", ports[3+i]), Routes: routes, ClusterName: "lib-test",
			},
			Region: fmt.Sprintf("m%d", i+1), Logger: quiet, ReadyAfter: natshard.Off,
		}
	}
	typ := natshard.Type{Name: "kv", Entity: newEnvEntity, Shards: 6}
	dirs := [3]string{t.TempDir(), t.TempDir(), t.TempDir()}
	var nodes [3]*natshard.Node
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			nodes[i], errs[i] = natshard.Start(ctx, opts(i, dirs[i]), typ)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("node %d: %v", i+1, err)
		}
		n := nodes[i]
		t.Cleanup(func() { _ = n.Close(context.Background()) })
	}
	for i, n := range nodes {
		if got, _ := n.Type("kv"); got.Replicas != 3 {
			t.Errorf("node %d: the type's replicas are %d, want 3 (the cluster's size)", i+1, got.Replicas)
		}
		if n.Options().LeaseTTL != natshard.ClusterLeaseTTL {
			t.Errorf("node %d: lease TTL %s, want the cluster's %s", i+1, n.Options().LeaseTTL, natshard.ClusterLeaseTTL)
		}
		name, err := os.ReadFile(filepath.Join(dirs[i], "natshard-server-name"))
		if want := fmt.Sprintf("natshard-m%d\n", i+1); err != nil || string(name) != want {
			t.Errorf("node %d: server name file %q, %v; want %q", i+1, name, err, want)
		}
	}
	natstest.Eventually(t, time.Minute, "every node ready (JetStream current)", func() error {
		for i, n := range nodes {
			if err := n.Ready(); err != nil {
				return fmt.Errorf("node %d: %w", i+1, err)
			}
		}
		return nil
	})
	// A client of the first member only.
	c := natshard.NewClient(natstest.Connect(t, nodes[0].ClientURL()))
	ask := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		got, err := c.Request(ctx, "kv", "order.42", []byte("hi"))
		if err == nil && !strings.HasSuffix(string(got), " hi") {
			err = fmt.Errorf("answer %q", got)
		}
		return err
	}
	natstest.Eventually(t, time.Minute, "an answer through the first member", ask)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := nodes[0].Stop(ctx); err != nil {
		t.Fatalf("stop the first member: %v", err)
	}
	natstest.Eventually(t, 90*time.Second, "an answer after the first member stopped", ask)
	for i, n := range nodes[1:] {
		natstest.Eventually(t, time.Minute, fmt.Sprintf("node %d ready", i+2), n.Ready)
	}
	// The last member alone has no JetStream majority: not ready, and
	// saying why (what a rolling restart must not come to).
	if err := nodes[1].Close(ctx); err != nil {
		t.Fatalf("close the second member: %v", err)
	}
	natstest.Eventually(t, time.Minute, "the last member not ready for want of JetStream", func() error {
		err := nodes[2].Ready()
		if err == nil || !errors.Is(err, natshard.ErrNotReady) || !strings.Contains(err.Error(), "JetStream is not current") {
			return fmt.Errorf("Ready: %v", err)
		}
		return nil
	})
}

// TestEmbeddedClusterRefused: cluster options that cannot work are
// refused before anything starts, naming the field.
func TestEmbeddedClusterRefused(t *testing.T) {
	typ := natshard.Type{Name: "x", Entity: newEnvEntity}
	for _, tc := range []struct {
		opts natshard.Options
		want string
	}{
		{natshard.Options{Server: natshard.ServerOptions{Routes: []string{"nats-route://127.0.0.1:6222"}}}, "Server.Routes: needs Server.Cluster"},
		{natshard.Options{Server: natshard.ServerOptions{Cluster: "127.0.0.1:6222"}}, "Server.Cluster: needs Server.Routes"},
		{natshard.Options{Server: natshard.ServerOptions{Cluster: "6222", Routes: []string{"nats-route://127.0.0.1:6222"}}}, "Server.Cluster"},
		{natshard.Options{Server: natshard.ServerOptions{Cluster: "127.0.0.1:6222", Routes: []string{"http://127.0.0.1:6222"}}}, "not a route URL"},
		{natshard.Options{NATS: "nats://127.0.0.1:4222", Server: natshard.ServerOptions{Cluster: "127.0.0.1:6222", Routes: []string{"nats-route://127.0.0.1:6222"}}}, "Server: configures the embedded server"},
	} {
		tc.opts.Logger = quiet
		tc.opts.Server.DataDir = t.TempDir()
		if _, err := natshard.Start(context.Background(), tc.opts, typ); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v; want an error saying %q", tc.opts.Server, err, tc.want)
		}
	}
}
