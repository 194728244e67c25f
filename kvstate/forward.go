package kvstate

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// Forward stores a copy of the message m, which the stream holds at
// sequence seq, on the data subject of entity id in shard (a child of the
// shard whose subject m is on: a split's forwarding, docs/PROTOCOL.md,
// Resharding), and returns once the stream stored it. The copy keeps m's
// data and headers, except JetStream's own (Nats-*: its Nats-Msg-Id goes
// to protocol.HeaderKey, where the entity finds its idempotency key), and
// carries protocol.HeaderForwarded (seq) and a Nats-Msg-Id made of seq:
// the same message forwarded again within the stream's duplicate window
// (its forwarder crashed before acknowledging it) is stored once.
// Errors as PublishOnce's.
func (s *Stream) Forward(ctx context.Context, m *nats.Msg, seq uint64, shard int, id string) error {
	if err := checkShard(shard); err != nil {
		return err
	}
	c := nats.NewMsg(s.subjects.Entity(shard, id))
	c.Data = m.Data
	for k, v := range m.Header {
		if !strings.HasPrefix(k, "Nats-") {
			c.Header[k] = v
		}
	}
	if key := protocol.IdempotencyKey(m.Header); key != "" {
		c.Header.Set(protocol.HeaderKey, key)
	}
	sq := strconv.FormatUint(seq, 10)
	c.Header.Set(protocol.HeaderForwarded, sq)
	// UniqueReplyMark: not an idempotency key of the entity's.
	c.Header.Set(protocol.HeaderMsgID, protocol.UniqueReplyMark+"fwd."+s.StreamOf(shard)+"."+sq)
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, _, err := PublishOnce(ctx, s.js, c); err != nil {
		return fmt.Errorf("forward message %d to shard %d: %w", seq, shard, err)
	}
	return nil
}
