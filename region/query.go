package region

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// onQuery answers a query about the region's shards and entities
// (protocol.QueryRequest, JSON) on the region's query subject: shardctl
// region, shard and stats ask every region this way. It runs on the query
// subscription's goroutine and changes nothing.
func (a *Agent) onQuery(m *nats.Msg) {
	ans, err := a.query(m.Data)
	var data []byte
	if err == nil {
		data, err = json.Marshal(ans)
	}
	if err == nil && int64(len(data)) > a.cfg.Conn.MaxPayload() {
		err = fmt.Errorf("answer of %d bytes exceeds the maximum payload; ask for fewer entity ids", len(data))
	}
	if err != nil {
		a.limit.log(a.log, "bad-query", "refused a query", "err", err)
		data, _ = json.Marshal(protocol.AdminError{Error: err.Error()})
	}
	if m.Reply != "" {
		if err := m.Respond(data); err != nil {
			a.log.Debug("cannot answer a query", "err", err)
		}
	}
}

func (a *Agent) query(body []byte) (protocol.QueryAnswer, error) {
	var req protocol.QueryRequest
	if len(bytes.TrimSpace(body)) > 0 {
		if err := protocol.DecodeJSON(body, &req); err != nil {
			return protocol.QueryAnswer{}, err
		}
	}
	for _, sh := range req.Shards {
		if n := a.layoutNow().Shards(); sh < 0 || sh >= n {
			return protocol.QueryAnswer{}, fmt.Errorf("bad request: shard %d out of range 0..%d", sh, n-1)
		}
	}
	switch {
	case req.Limit < 0 || req.Limit > protocol.MaxEntityLimit:
		return protocol.QueryAnswer{}, fmt.Errorf("bad request: limit %d out of range 0..%d", req.Limit, protocol.MaxEntityLimit)
	case req.Limit == 0:
		req.Limit = protocol.DefaultEntityLimit
	}

	v := a.viewNow()
	ans := protocol.QueryAnswer{Region: a.cfg.ID, Incarnation: v.incarnation, Instance: a.instance, Shards: []protocol.ShardReport{}}
	held, modes := v.held, v.modes

	loads, _ := a.loads(held)
	// Entity ids fill at most half of a NATS message, whatever the limit.
	budget, left := int(a.cfg.Conn.MaxPayload()/2), req.Limit
	for i, sh := range held {
		if len(req.Shards) > 0 && !slices.Contains(req.Shards, sh) {
			continue
		}
		rate := math.Round(loads[i].Rate*1000) / 1000
		r := protocol.ShardReport{Shard: sh, Mode: modes[sh].String(), Entities: loads[i].Entities, MessagesPerSecond: rate}
		if req.Entities {
			ids := a.host.Entities(sh)
			r.Entities = len(ids)
			for _, id := range ids {
				quoted, _ := json.Marshal(id)
				if left == 0 || budget < len(quoted)+1 {
					r.Truncated = true
					break
				}
				budget -= len(quoted) + 1
				left--
				r.EntityIDs = append(r.EntityIDs, id)
			}
		}
		ans.Shards = append(ans.Shards, r)
	}
	return ans, nil
}
