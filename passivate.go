package natshard

import (
	"context"
	"fmt"
	"time"

	"github.com/natshard/natshard/protocol"
)

// Passivate stops the entity id of type typ if this node holds it, as an
// idle passivation does: its Stop hook runs, and its next message
// activates a new incarnation (a remembered entity stays remembered). It
// waits while the entity is busy and until it has stopped, or ctx ends.
// It reports whether the node held the entity. For tests (natshardtest)
// and operators; an entity that wants to stop calls Env.Passivate.
func (n *Node) Passivate(ctx context.Context, typ, id string) (bool, error) {
	var h *hosted
	for _, x := range n.hostedTypes() {
		if x.t.Name == typ && x.agent != nil {
			h = x
		}
	}
	if h == nil {
		return false, fmt.Errorf("natshard: passivate: the node hosts no region of type %q", typ)
	}
	shard := protocol.ShardOf(id, h.t.Shards)
	found := false
	for {
		held, started := h.agent.PassivateNow(shard, id)
		if !held {
			return found, nil
		}
		found = true
		_ = started // a stop began, or the entity is busy: look again
		select {
		case <-ctx.Done():
			return true, fmt.Errorf("natshard: passivate %s %s: %w", typ, id, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}
