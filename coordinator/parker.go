package coordinator

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/drain"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// parker holds the shards that have no live owner: it subscribes to their
// subjects and diverts what arrives to their buffers (DESIGN.md 6,
// Parking), exactly as a pausing region does.
type parker struct {
	nc       *nats.Conn
	buffer   *kvstate.Buffer
	subjects protocol.Subjects
	log      *slog.Logger
	stats    *Stats // set by the leader; nil counts nothing

	mu     sync.Mutex
	parked map[int]*parked
}

type parked struct {
	sub     *nats.Subscription
	handoff uint64
}

func newParker(nc *nats.Conn, b *kvstate.Buffer, s protocol.Subjects, log *slog.Logger) *parker {
	return &parker{nc: nc, buffer: b, subjects: s, log: log, parked: map[int]*parked{}}
}

// park starts diverting shard's messages, or, when it does already,
// records the new handoff id.
func (p *parker) park(shard int, handoff uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pk, ok := p.parked[shard]; ok {
		pk.handoff = handoff
		return nil
	}
	trace := p.log.Enabled(context.Background(), slog.LevelDebug)
	sub, err := p.nc.Subscribe(p.subjects.Shard(shard), func(m *nats.Msg) {
		if trace {
			p.log.Debug("parked a message", "shard", shard, "key", protocol.MessageKey(m.Header, m.Reply))
		}
		if p.stats != nil {
			p.stats.ParkedMessages.Add(1)
		}
		p.buffer.Append(shard, m, p.failed)
	})
	if err != nil {
		return err
	}
	_ = sub.SetPendingLimits(-1, -1)
	p.parked[shard] = &parked{sub: sub, handoff: handoff}
	return p.nc.Flush()
}

// failed makes a refused append visible: an error reply to a request, and a
// log line.
func (p *parker) failed(m *nats.Msg, err error) {
	if p.stats != nil {
		p.stats.ParkRefused.Add(1)
	}
	p.log.Warn("a parked shard's message could not be buffered", "subject", m.Subject, "err", err)
	if m.Reply != "" {
		_ = p.nc.PublishMsg(protocol.RefusedReply(m.Reply, protocol.RefusedMoving, nil, fmt.Errorf("not buffered: %w", err)))
	}
}

// unsubscribe stops diverting shard if it is parked under handoff. It
// drains the subscription (package drain says why) and returns when it is
// closed.
func (p *parker) unsubscribe(shard int, handoff uint64) {
	p.mu.Lock()
	pk, ok := p.parked[shard]
	if !ok || pk.handoff != handoff {
		p.mu.Unlock()
		return
	}
	delete(p.parked, shard)
	p.mu.Unlock()
	if err := drain.Subscription(context.Background(), pk.sub, drainTimeout); err != nil {
		p.log.Warn("a parked shard's subscription did not drain; cut", "shard", shard, "err", err)
	}
}

// drainTimeout bounds the drain of a parked shard's subscription.
const drainTimeout = 30 * time.Second

// stop ends every parking (the term of leadership ended; the next
// coordinator parks again).
func (p *parker) stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for shard, pk := range p.parked {
		_ = pk.sub.Unsubscribe()
		delete(p.parked, shard)
	}
}
