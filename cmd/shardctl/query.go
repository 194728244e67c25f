package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// askRegions sends req to the query subject of every region in ids at
// once, each bounded by --timeout, and returns the answers and, for the
// regions that did not answer, why (Akka's "failed" set): such a region
// does not fail the command, it is reported.
func (c *client) askRegions(ctx context.Context, ids []string, req protocol.QueryRequest) (map[string]protocol.QueryAnswer, map[string]string) {
	data, _ := json.Marshal(req)
	answers := map[string]protocol.QueryAnswer{}
	failed := map[string]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, id := range ids {
		if err := protocol.ValidateName("region id", id); err != nil {
			mu.Lock()
			failed[id] = fmt.Sprintf("not asked: the coordinator named an invalid region id: %v", err)
			mu.Unlock()
			continue
		}
		wg.Go(func() {
			ans, err := c.askRegion(ctx, id, data)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed[id] = err.Error()
			} else {
				answers[id] = ans
			}
		})
	}
	wg.Wait()
	return answers, failed
}

func (c *client) askRegion(ctx context.Context, id string, data []byte) (protocol.QueryAnswer, error) {
	var ans protocol.QueryAnswer
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	m, err := c.nc.RequestWithContext(ctx, c.subjects.Query(id), data)
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return ans, errors.New("no responders: not running, or a version that answers no queries")
	case errors.Is(err, context.DeadlineExceeded):
		return ans, fmt.Errorf("no answer within %v", c.opts.Timeout)
	case err != nil:
		return ans, err
	}
	var e protocol.AdminError
	if json.Unmarshal(m.Data, &e) == nil && e.Error != "" {
		return ans, fmt.Errorf("refused: %s", e.Error)
	}
	if err := json.Unmarshal(m.Data, &ans); err != nil {
		return ans, fmt.Errorf("answered garbage: %w", err)
	}
	return ans, nil
}

// printFailed prints the regions that did not answer, one line each.
func printFailed(out io.Writer, failed map[string]string) {
	ids := make([]string, 0, len(failed))
	for id := range failed {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		say(out, "failed: region %s did not answer: %s\n", id, failed[id])
	}
}

// idList is entity ids for a table cell, saying how many were left out.
func idList(r protocol.ShardReport) string {
	s := strings.Join(r.EntityIDs, " ")
	if more := r.Entities - len(r.EntityIDs); more > 0 {
		if s != "" {
			s += " "
		}
		s += fmt.Sprintf("... (%d more)", more)
	}
	return orDash(s)
}
