package coordinator_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
)

// TestCoordinatorLog (issue 16): at INFO the coordinator says who joined
// and every rebalance round's decision, in a handful of lines, not one per
// shard; durations in a JSON log are strings people read, not integer
// nanoseconds.
func TestCoordinatorLog(t *testing.T) {
	nc, store, buffer, subjects := openType(t)
	var logs natstest.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	runCandidate(t, coordinator.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "coord",
		MinRegions: 3, ReleaseGrace: -1, Settle: 200 * time.Millisecond, Logger: log})
	natstest.Eventually(t, 20*time.Second, "a coordinator answers", func() error { _, err := status(nc, subjects); return err })
	for _, id := range []string{"a", "b", "c"} {
		openRegion(t, nc, store, buffer, subjects, id, entities.Echo())
	}
	leaderIs(t, nc, subjects, "coord", 0)
	// 6, 5 and 5 shards; d's join makes it 4 each, in one round.
	openRegion(t, nc, store, buffer, subjects, "d", entities.Echo())

	type line struct {
		Msg    string `json:"msg"`
		Level  string `json:"level"`
		Region string `json:"region"`
		Moves  int    `json:"moves"`
		FromTo string `json:"from_to"`
		Took   any    `json:"took"`
		Reason string `json:"reason"`
	}
	var lines []line
	natstest.Eventually(t, 20*time.Second, "the round after d joined, done", func() error {
		lines = nil
		sc := bufio.NewScanner(strings.NewReader(logs.String()))
		done := false
		for sc.Scan() {
			var l line
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				return fmt.Errorf("log line %q: %v", sc.Text(), err)
			}
			lines = append(lines, l)
			done = done || l.Msg == "rebalance round done"
		}
		if !done {
			return fmt.Errorf("no round done in %d lines", len(lines))
		}
		return nil
	})
	joined, rounds := map[string]bool{}, 0
	for _, l := range lines {
		switch l.Msg {
		case "region joined":
			joined[l.Region] = true
		case "rebalance round":
			rounds++
			if l.Moves != 4 || l.FromTo != "a->d:2 b->d:1 c->d:1" {
				t.Errorf("round %+v, want 4 moves to d: 2 from a, 1 from b and c", l)
			}
		case "rebalance round done":
			took, ok := l.Took.(string)
			if d, err := time.ParseDuration(took); !ok || err != nil || d <= 0 {
				t.Errorf("took %#v: not a duration people read", l.Took)
			}
		}
	}
	if !joined["a"] || !joined["b"] || !joined["c"] || !joined["d"] || rounds != 1 {
		t.Errorf("joins %v, %d rounds; want a, b, c, d and one round", joined, rounds)
	}
	if len(lines) >= shards {
		t.Errorf("%d INFO lines for %d shards: a line per shard?\n%s", len(lines), shards, logs.String())
	}
}
