package coordinator

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/natshard/natshard/protocol"
)

// The coordinator's log lines say what it decided in words and small
// summaries: a line per decision at INFO (joins, leaves, deaths, the
// lease, every rebalance round), per-shard detail at DEBUG.

// duration is d for a log line, rounded to what people read ("312ms",
// "1.52s"): slog's JSON handler would print a time.Duration as integer
// nanoseconds.
func duration(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= 10*time.Millisecond:
		return d.Round(time.Millisecond).String()
	}
	return d.Round(10 * time.Microsecond).String()
}

// movesSummary counts moves by source and planned target: "a->d:86 b->d:85".
func movesSummary(moves []protocol.PlannedMove) string {
	n := map[string]int{}
	for _, m := range moves {
		to := m.To
		if to == "" {
			to = "?"
		}
		n[m.From+"->"+to]++
	}
	return countsSummary(n)
}

// countsSummary is "key:count" pairs in key order.
func countsSummary(n map[string]int) string {
	var b strings.Builder
	for i, k := range slices.Sorted(maps.Keys(n)) {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s:%d", k, n[k])
	}
	return b.String()
}

// shardsOf lists the shards of moves.
func shardsOf(moves []protocol.PlannedMove) []int {
	out := make([]int, len(moves))
	for i, m := range moves {
		out[i] = m.Shard
	}
	return out
}
