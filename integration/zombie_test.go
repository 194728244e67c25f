package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestSIGSTOPSourceMidHandoff (issue 30, violation A; PROTOCOL.md, Zombie
// regions): region a (never the coordinator) is SIGSTOPped while a
// publisher sends numbered appends, each with a Nats-Msg-Id, to an entity
// of one of its shards; the shard is moved to b at once. The coordinator
// waits out the handoff timeout (1 s), takes the shard over (fence, park,
// drop sent to a, bind b) and b replays what it diverts. a is woken
// (SIGCONT) before its registration deadline, with the old handoff
// command, the messages published meanwhile and the drop queued. The
// entity's list (kv, saved with compare-and-set) must hold each value at
// most once and in publish order, every value published after b took the
// shard over must be there (the values published to the frozen a may be
// lost: the forced reallocation's crash window), and the woken a must not
// hold the shard.
func TestSIGSTOPSourceMidHandoff(t *testing.T) {
	opts := natstest.DefaultOptions(t)
	opts.PingInterval = time.Minute // the server must not close the stopped process's connection
	srv := natstest.RunServerWithOptions(t, opts)
	url := natstest.URL(srv)
	subjects := protocol.MustSubjects("", "", "kv")
	common := []string{"--nats", url, "--type", "kv", "--kind", "kv", "--shards", "8", "--min-regions", "2",
		"--rebalance-interval", "0", "--handoff-timeout", "1s", "--lease-ttl", "30s"}
	start := func(name string, extra ...string) *proc {
		return startShardd(t, name, append(append([]string{"--region", name}, common...), extra...)...)
	}
	nc := connect(t, url)
	b := start("b") // the coordinator: a never is
	a := start("a", "--no-coordinator")
	st := waitSettled(t, nc, subjects, 60*time.Second, "a", "b")

	x := -1
	for _, s := range st.Table {
		if s.Region == "a" {
			x = s.Shard
			break
		}
	}
	if x < 0 {
		t.Fatalf("a holds no shard: %+v", st.Table)
	}
	var id string
	for i := 0; ; i++ {
		if id = fmt.Sprintf("zombie-%d", i); protocol.ShardOf(id, st.Shards) == x {
			break
		}
	}
	subject := subjects.Entity(x, id)

	var sent atomic.Int64
	stop := make(chan struct{})
	published := make(chan struct{})
	pub := connect(t, url)
	go func() {
		defer close(published)
		for v := 1; ; v++ {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			m := nats.NewMsg(subject)
			m.Data = fmt.Appendf(nil, `{"op":"append","key":"l","value":%d}`, v)
			m.Header.Set(protocol.HeaderMsgID, id+"/"+strconv.Itoa(v))
			if err := pub.PublishMsg(m); err != nil {
				t.Error(err)
				return
			}
			sent.Store(int64(v))
		}
	}()
	natstest.Eventually(t, 30*time.Second, "a applies the appends", func() error {
		if n := len(listOf(t, nc, subject)); n < 50 {
			return fmt.Errorf("%d applied", n)
		}
		return nil
	})

	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stoppedAt := sent.Load()
	t0 := time.Now()
	body, _ := json.Marshal(protocol.MoveRequest{Shard: x, Region: "b"})
	if _, err := nc.Request(subjects.Admin(protocol.AdminMove), body, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// The forced reallocation, then b serving what the coordinator diverted.
	var tookOver int64
	natstest.Eventually(t, 30*time.Second, "the shard active on b", func() error {
		st, err := status(nc, subjects)
		if err != nil {
			return err
		}
		if r := st.Table[x]; r.State != "active" || r.Region != "b" {
			return fmt.Errorf("shard %d %s on %q", x, r.State, r.Region)
		}
		tookOver = sent.Load()
		return nil
	})
	want := tookOver + 200
	natstest.Eventually(t, 30*time.Second, "more appends published", func() error {
		if sent.Load() < want {
			return fmt.Errorf("%d published", sent.Load())
		}
		return nil
	})
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	t.Logf("a stopped after %d values for %s; the shard active on b after %d values", stoppedAt, time.Since(t0).Round(time.Millisecond), tookOver)
	if forced := fmt.Sprintf("handoff of shard %d from region a timed out", x); !strings.Contains(b.log.String(), forced) {
		t.Fatalf("the move was not a forced reallocation (no %q in b's log): the test did not test it", forced)
	}
	contAt := sent.Load()
	natstest.Eventually(t, 30*time.Second, "more appends published after SIGCONT", func() error {
		if sent.Load() < contAt+500 {
			return fmt.Errorf("%d published", sent.Load())
		}
		return nil
	})
	close(stop)
	<-published
	last := int(sent.Load())

	var got []int
	natstest.Eventually(t, 30*time.Second, "the last value applied", func() error {
		got = listOf(t, nc, subject)
		if len(got) == 0 || got[len(got)-1] != last {
			return fmt.Errorf("%d applied, last %v", len(got), got[max(0, len(got)-1):])
		}
		return nil
	})
	have := map[int]bool{}
	for i, v := range got {
		if have[v] {
			t.Errorf("value %d applied twice (at %d)", v, i)
		}
		have[v] = true
		if i > 0 && v <= got[i-1] {
			t.Errorf("value %d applied after %d (at %d of %d): %v", v, got[i-1], i, len(got), got[max(0, i-10):min(len(got), i+10)])
		}
	}
	lost := 0
	for v := 1; v <= last; v++ {
		if !have[v] {
			lost++
			if v > int(tookOver) {
				t.Errorf("value %d, published after b took the shard over, lost", v)
			}
		}
	}
	t.Logf("%d values published, %d applied, %d lost (published to the stopped a, from %d)", last, len(got), lost, stoppedAt)

	natstest.Eventually(t, 30*time.Second, "the woken a without the shard", func() error {
		shards, err := heldBy(nc, subjects, "a")
		if err != nil {
			return err
		}
		for _, s := range shards {
			if s == x {
				return fmt.Errorf("a holds shards %v", shards)
			}
		}
		return nil
	})
}

// listOf reads the kv entity's list "l" (its values, in order).
func listOf(t *testing.T, nc *nats.Conn, subject string) []int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	out, err := kvRequest(ctx, nc, subject, `{"op":"get","key":"l"}`)
	if err != nil {
		return nil
	}
	vs, _ := out["value"].([]any)
	got := make([]int, 0, len(vs))
	for _, v := range vs {
		f, _ := v.(float64)
		got = append(got, int(f))
	}
	return got
}

// heldBy asks region id which shards it holds (its query subject).
func heldBy(nc *nats.Conn, subjects protocol.Subjects, id string) ([]int, error) {
	body, _ := json.Marshal(protocol.QueryRequest{})
	m, err := nc.Request(subjects.Query(id), body, 2*time.Second)
	if err != nil {
		return nil, err
	}
	var ans protocol.QueryAnswer
	if err := json.Unmarshal(m.Data, &ans); err != nil {
		return nil, err
	}
	var held []int
	for _, r := range ans.Shards {
		held = append(held, r.Shard)
	}
	return held, nil
}
