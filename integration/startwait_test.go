package integration

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestStartTogether: three shardd started at once on a fresh three-server
// NATS cluster of which only one server is up (no JetStream meta leader:
// no majority) wait for JetStream, saying so in their logs and on /readyz,
// and all come up, without a restart, once the other two servers start
// (issue 32: "three processes started at once on a fresh cluster, in any
// order, all come up without a restart"; before, each exited with
// "open its KV bucket: ... context deadline exceeded").
func TestStartTogether(t *testing.T) {
	c := newNATS(t, "127.0.0.1")
	c.start(0)
	// The server accepts connections before the shardd start: a start
	// waits for JetStream, not for a first connection (OPERATIONS.md,
	// Start-up; one CI run had c exit with "no servers available").
	natstest.Eventually(t, time.Minute, "nats-server n1 accepting connections", func() error {
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", c.client[0]), time.Second)
		if err == nil {
			conn.Close()
		}
		return err
	})
	url := c.urls("127.0.0.1")
	httpPort := freePort(t)
	procs := map[string]*proc{}
	for _, name := range []string{"a", "b", "c"} {
		args := []string{"--region", name, "--nats", url, "--replicas", "3", "--type", "kv", "--kind", "kv", "--shards", "16", "--start-timeout", "10m"}
		if name == "a" {
			args = append(args, "--http", fmt.Sprintf("127.0.0.1:%d", httpPort))
		}
		procs[name] = startShardd(t, name, args...)
	}
	for name, p := range procs {
		natstest.Eventually(t, 2*time.Minute, "shardd "+name+" saying that it waits for JetStream", func() error {
			select {
			case <-p.done:
				t.Fatalf("shardd %s exited while JetStream was unavailable: %v", name, p.exitErr)
			default:
			}
			if !strings.Contains(p.log.String(), `msg="waiting for JetStream" type=kv for="its KV bucket natshard_kv"`) {
				return fmt.Errorf("no such line in its log")
			}
			return nil
		})
	}
	code, body := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/readyz", httpPort))
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "waiting") || !strings.Contains(body, "natshard_kv") {
		t.Errorf("/readyz of a while it waits: %d %q", code, body)
	}
	c.start(1)
	c.start(2)
	nc := connect(t, url)
	waitSettled(t, nc, protocol.MustSubjects("", "", "kv"), 3*time.Minute, "a", "b", "c")
	for name, p := range procs {
		select {
		case <-p.done:
			t.Fatalf("shardd %s exited: %v", name, p.exitErr)
		default:
		}
		if !strings.Contains(p.log.String(), `msg="JetStream available: done waiting"`) {
			t.Errorf("shardd %s did not log the end of its wait", name)
		}
	}
	natstest.Eventually(t, time.Minute, "/readyz of a ok", func() error {
		if code, body := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/readyz", httpPort)); code != http.StatusOK {
			return fmt.Errorf("%d %q", code, body)
		}
		return nil
	})
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
