package coordinator

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// This file holds the leader's answers to the admin API: requests that
// change the table and the status.

// answerAdmin answers an admin API request. The actions a request starts
// (table and pin writes, commands) are carried out before the answer, so
// that an answer of success means they were accepted; an error carrying
// them out ends the term, like any failed write.
func (l *leader) answerAdmin(ctx context.Context, m *nats.Msg) error {
	var (
		body any
		acts []Action
		err  error
	)
	if verb := m.Subject[len(l.cfg.Subjects.Admin("")):]; verb == protocol.AdminStatus {
		body = l.status()
	} else {
		body, acts, err = l.core.AdminRequest(verb, m.Data)
	}
	var failed error
	if err == nil {
		failed = l.execute(ctx, acts)
		err = failed
	}
	if err != nil {
		body = protocol.AdminError{Error: err.Error(), Retry: errors.Is(err, ErrSplitBusy) && failed == nil}
	}
	data, _ := json.Marshal(body)
	if m.Reply != "" {
		_ = m.Respond(data)
	}
	return failed
}

func (l *leader) status() protocol.Status {
	cfg := l.core.TypeConfig()
	st := protocol.Status{
		Type:        l.cfg.Subjects.Type(),
		Shards:      cfg.Shards,
		History:     cfg.History,
		SplittingTo: cfg.To,
		Coordinator: protocol.CoordinatorView{Region: l.cfg.Region, Epoch: l.core.Epoch()},
	}
	count := map[string]int{}
	pins := l.core.Pins()
	for _, r := range l.core.Table() {
		st.Table = append(st.Table, protocol.ShardView{Shard: r.Shard, Region: r.Region, State: string(r.State), Source: r.Source, Pin: pins[r.Shard]})
		count[r.Region]++
	}
	for _, r := range l.core.Regions() {
		st.Regions = append(st.Regions, protocol.RegionView{
			ID: r.Info.ID, Incarnation: r.Info.Incarnation, Version: r.Info.Version, Leaving: r.Info.Leaving, Shards: count[r.Info.ID],
		})
	}
	return st
}
