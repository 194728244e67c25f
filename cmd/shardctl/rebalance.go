package main

import (
	"context"
	"fmt"
	"io"

	"github.com/natshard/natshard/protocol"
)

func cmdRebalance(ctx context.Context, c *client, _ []string, out io.Writer) error {
	w, err := c.startWait()
	if err != nil {
		return err
	}
	defer w.stop()
	var ans protocol.RebalanceAnswer
	if err := c.admin(ctx, protocol.AdminRebalance, protocol.RebalanceRequest{DryRun: c.opts.DryRun}, &ans); err != nil {
		return err
	}
	if ans.Moves == nil {
		ans.Moves = []protocol.PlannedMove{}
	}
	res := struct {
		protocol.RebalanceAnswer
		// Done says what --wait waited for, once it is so.
		Done string `json:"done,omitempty"`
	}{RebalanceAnswer: ans}
	if !c.opts.JSON {
		if err := printPlan(out, ans); err != nil {
			return err
		}
	}
	if w != nil && len(ans.Moves) > 0 {
		if res.Done, err = w.until(ctx, rebalanceGoal(ans.Moves)); err != nil {
			return err
		}
		if !c.opts.JSON {
			say(out, "%s\n", res.Done)
		}
	}
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	return nil
}

func printPlan(out io.Writer, ans protocol.RebalanceAnswer) error {
	verb := "moving"
	if ans.DryRun {
		verb = "dry run: would move"
	}
	switch len(ans.Moves) {
	case 0:
		fmt.Fprintln(out, "nothing to move")
	case 1:
		fmt.Fprintf(out, "%s 1 shard\n", verb)
	default:
		fmt.Fprintf(out, "%s %d shards\n", verb, len(ans.Moves))
	}
	if ans.InProgress > 0 {
		fmt.Fprintf(out, "%d shards are moving or parked; most strategies wait until they are active\n", ans.InProgress)
	}
	if len(ans.Moves) == 0 {
		return nil
	}
	rows := make([][]any, len(ans.Moves))
	for i, m := range ans.Moves {
		rows[i] = []any{m.Shard, m.From, orDash(m.To)}
	}
	return table(out, []string{"SHARD", "FROM", "TO"}, rows)
}
