package main

import (
	"context"
	"fmt"
	"io"
)

type statusJSON struct {
	Type   string `json:"type"`
	Shards int    `json:"shards"`
	// History: the type's earlier shard counts (it was resharded);
	// SplittingTo: the count a split under way goes to.
	History     []int `json:"history,omitempty"`
	SplittingTo int   `json:"splitting_to,omitempty"`
	Coordinator struct {
		Region string `json:"region"`
		Epoch  uint64 `json:"epoch"`
	} `json:"coordinator"`
	CoordinatorAnswered bool `json:"coordinator_answered"`
	Regions             int  `json:"regions"`
	Allocated           int  `json:"allocated"`
	Active              int  `json:"active"`
	Unowned             int  `json:"unowned"`
}

func cmdStatus(ctx context.Context, c *client, _ []string, out io.Writer) error {
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	var s statusJSON
	s.Type, s.Shards, s.History, s.SplittingTo = v.Type, v.Shards, v.History, v.SplittingTo
	s.Coordinator.Region, s.Coordinator.Epoch = v.Coordinator.Region, v.Coordinator.Epoch
	s.CoordinatorAnswered = v.Answered
	s.Regions = len(v.Regions)
	for _, r := range v.Table {
		switch {
		case r.Region == "":
			s.Unowned++
		case r.State == "active":
			s.Active++
			s.Allocated++
		default:
			s.Allocated++
		}
	}
	if c.opts.JSON {
		return writeJSON(out, s)
	}
	coord := "none"
	if s.Coordinator.Region != "" {
		coord = fmt.Sprintf("%s (epoch %d)", s.Coordinator.Region, s.Coordinator.Epoch)
	}
	shards := fmt.Sprintf("%d shards", s.Shards)
	if len(s.History) > 0 {
		shards += fmt.Sprintf(", split from %v", s.History)
	}
	if s.SplittingTo != 0 {
		shards += fmt.Sprintf(", splitting to %d", s.SplittingTo)
	}
	say(out, "type:        %s (%s)\n", s.Type, shards)
	say(out, "coordinator: %s\n", coord)
	fmt.Fprintf(out, "regions:     %d\n", s.Regions)
	fmt.Fprintf(out, "shards:      %d allocated (%d active), %d unowned\n", s.Allocated, s.Active, s.Unowned)
	kvNote(out, v, 13)
	return nil
}
