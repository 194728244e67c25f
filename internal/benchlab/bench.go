package benchlab

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// recvCounter counts messages at the receiving side and notes when the
// count reaches its target.
type recvCounter struct {
	n      atomic.Int64
	target atomic.Int64
	end    atomic.Int64 // since0() when n reached target
	done   atomic.Pointer[chan struct{}]
}

func (c *recvCounter) add() {
	if c.n.Add(1) == c.target.Load() {
		c.end.Store(since0())
		close(*c.done.Load())
	}
}

// reset starts counting from zero towards target (0: no target); the
// channel is closed when it is reached.
func (c *recvCounter) reset(target int64) <-chan struct{} {
	ch := make(chan struct{})
	c.target.Store(-1)
	c.n.Store(0)
	c.done.Store(&ch)
	if target > 0 {
		c.target.Store(target)
	}
	return ch
}

// bench runs the workloads of shardctl bench on a system.
type bench struct {
	ctx   context.Context
	cfg   Config
	sys   *System
	tally *tally // what the system's entities handled
	prog  *progress
	sides *SideProfiles // --side-profiles (nil: none)

	pubs      []*nats.Conn // publishers, for both sides
	requester *nats.Conn   // latency and handoff requests, for both sides
	raw       recvCounter  // what the raw subscribers (or consumers) received
	ids       []string     // entity ids
	natSubj   []string     // natshard subject of each entity
	rawSubj   []string     // raw subject of each entity: same depth, another prefix
	payload   []byte       // throughput payload
	reqBody   []byte       // latency request

	// Durable delivery only: the publishers' JetStream contexts (at most
	// ackWindow publishes each waiting for their acknowledgement) and the
	// requester's; what they had acknowledged and what failed.
	pubJS   []jetstream.JetStream
	reqJS   jetstream.JetStream
	acked   atomic.Int64
	pubErrs atomic.Int64
	lastErr atomic.Pointer[error] // the last publish that failed
	// raw JetStream in the type's shape: its streams (copies of the
	// type's message streams' configurations), deleted by close, and one
	// pull consumer per shard (a copy of the type's), each read by a
	// goroutine of rawPulls.
	rawStreams []jetstream.StreamConfig // as the type's message streams: shard s in s mod len
	msgStreams []string                 // the type's message streams
	rawIters   []jetstream.MessagesContext
	rawPulls   sync.WaitGroup
	// raw JetStream in its best shape (best.go): what its
	// consumers received, and the subject of each entity there.
	best     bestShape
	bestRecv recvCounter
	bestSubj []string
}

// rawPrefix is the first token of the raw NATS side's subjects.
const rawPrefix = "rawbench"

// rawPullBatch is what each raw consumer's iterator keeps buffered: as a
// region's (region.pullBatch).
const rawPullBatch = 256

// newBench opens the publishers and the raw side: one subscriber
// connection per region, each subscribed to the same shards (raw
// subjects) as its region; with durable delivery, each pulling from a
// consumer per shard on a stream of raw subjects.
func newBench(ctx context.Context, cfg Config, sys *System, t *tally, prog *progress) (*bench, error) {
	b := &bench{ctx: ctx, cfg: cfg, sys: sys, tally: t, prog: prog}
	b.cfg.Msgs = b.cfg.msgsFor(sys.cfg.Delivery)
	if err := b.open(); err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

func (b *bench) durable() bool { return b.sys.cfg.Delivery == natshard.Durable }

func (b *bench) open() error {
	cfg, sys := b.cfg, b.sys
	b.raw.reset(0)
	b.bestRecv.reset(0)
	b.tally.handled.reset(0)
	for i := range cfg.Pubs {
		nc, err := sys.Connect("pub-" + strconv.Itoa(i))
		if err != nil {
			return err
		}
		b.pubs = append(b.pubs, nc)
		if b.durable() {
			js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(b.ackWindow()),
				jetstream.WithPublishAsyncAckHandler(func(jetstream.JetStream, *nats.Msg, *jetstream.PubAck) { b.acked.Add(1) }),
				jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, _ *nats.Msg, err error) {
					b.pubErrs.Add(1)
					b.lastErr.Store(&err)
				}))
			if err != nil {
				return err
			}
			b.pubJS = append(b.pubJS, js)
		}
	}
	var err error
	if b.requester, err = sys.Connect("requester"); err != nil {
		return err
	}
	var consumer jetstream.ConsumerConfig
	if b.durable() {
		if b.reqJS, err = jetstream.New(b.requester); err != nil {
			return err
		}
		if consumer, err = b.openRawStream(); err != nil {
			return err
		}
		if err := b.openBest(b.rawStreams[0]); err != nil {
			return err
		}
	}
	st, err := sys.Status()
	if err != nil {
		return fmt.Errorf("coordinator status: %w", err)
	}
	own := owners(st)
	for _, id := range sys.RegionIDs() {
		nc, err := sys.Connect("raw-" + id)
		if err != nil {
			return err
		}
		if b.durable() {
			if err := b.pullRaw(nc, consumer, own[id]); err != nil {
				return err
			}
			continue
		}
		for _, shard := range own[id] {
			sub, err := nc.Subscribe(b.rawShard(shard), b.onRaw)
			if err != nil {
				return err
			}
			_ = sub.SetPendingLimits(-1, -1) // as a region's shard subscriptions
		}
		if err := nc.Flush(); err != nil {
			return err
		}
	}
	for i := range cfg.Entities {
		id := "e-" + strconv.Itoa(i)
		shard := protocol.ShardOf(id, cfg.Shards)
		b.ids = append(b.ids, id)
		b.natSubj = append(b.natSubj, sys.subjects.Entity(shard, id))
		b.rawSubj = append(b.rawSubj, b.rawEntity(shard, id))
		b.bestSubj = append(b.bestSubj, b.bestEntity(shard, id))
	}
	b.payload = make([]byte, cfg.Size)
	for i := range b.payload {
		b.payload[i] = 'a' + byte(i%26)
	}
	b.reqBody = b.payload
	if cfg.Kind == "kv" {
		b.payload = fmt.Appendf(nil, `{"op":"set","key":"v","value":"%s"}`, strings.Repeat("x", cfg.Size-minKVSize))
		b.reqBody = []byte(`{"op":"get","key":"v"}`)
	}
	return nil
}

// ackWindow is how many publishes each publisher may have waiting for
// their acknowledgement: the --window shared among the publishers.
func (b *bench) ackWindow() int {
	return (b.cfg.Window + b.cfg.Pubs - 1) / b.cfg.Pubs
}

// messageStreams returns the type's message streams, in order (shard s
// in stream s mod their number): its single stream, or those its messages
// are split over (kvstate.MessageStreams).
func messageStreams(ctx context.Context, js jetstream.JetStream, typ string) ([]jetstream.Stream, error) {
	var found []jetstream.Stream
	for _, name := range kvstate.AllMessageStreams(typ) {
		st, err := js.Stream(ctx, name)
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			continue
		case err != nil:
			return nil, fmt.Errorf("the message stream %s of type %s: %w", name, typ, err)
		case name == kvstate.MessageStream(typ):
			return []jetstream.Stream{st}, nil
		}
		found = append(found, st)
	}
	if len(found) == 0 || !slices.Equal(streamNames(found), kvstate.MessageStreams(typ, len(found))) {
		return nil, fmt.Errorf("type %s has message streams %q, not a single one nor %d split ones", typ, streamNames(found), len(found))
	}
	return found, nil
}

func streamNames(sts []jetstream.Stream) []string {
	var names []string
	for _, st := range sts {
		names = append(names, st.CachedInfo().Config.Name)
	}
	return names
}

// openRawStream creates raw JetStream's streams, copies of the
// configurations of the type's message streams on the raw subjects
// (shard s in stream s mod their number, as the type's; without the
// type's source of fired reminders, which is idle in the bench), and
// returns the configuration of the type's shard consumers (read from one
// of them) for the raw ones.
func (b *bench) openRawStream() (jetstream.ConsumerConfig, error) {
	ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
	defer cancel()
	js := b.sys.js
	nat, err := messageStreams(ctx, js, b.sys.cfg.Type)
	if err != nil {
		return jetstream.ConsumerConfig{}, err
	}
	b.msgStreams = streamNames(nat)
	// Every shard has its consumer once the system settled; their names
	// are the protocol's (docs/PROTOCOL.md, "Durable delivery").
	consumer, err := nat[0].Consumer(ctx, shardConsumer(0))
	if err != nil {
		return jetstream.ConsumerConfig{}, fmt.Errorf("the consumer of shard 0 of type %s: %w", b.sys.cfg.Type, err)
	}
	k := len(nat)
	for i, st := range nat {
		sc := st.CachedInfo().Config
		sc.Name = rawPrefix + "_" + b.sys.cfg.Type
		sc.Description = "shardctl bench: raw JetStream beside type " + b.sys.cfg.Type
		sc.Subjects = []string{rawPrefix + "." + b.sys.cfg.Type + ".>"}
		if k > 1 {
			sc.Name += "~" + strconv.Itoa(i)
			sc.Subjects = nil
			for shard := i; shard < b.cfg.Shards; shard += k {
				sc.Subjects = append(sc.Subjects, b.rawShard(shard))
			}
		}
		sc.Sources = nil
		if _, err := js.Stream(ctx, sc.Name); err == nil {
			return jetstream.ConsumerConfig{}, fmt.Errorf("%w: stream %s exists on %s already; pass another --type", ErrUsage, sc.Name, b.sys.url)
		}
		if _, err := js.CreateStream(ctx, sc); err != nil {
			return jetstream.ConsumerConfig{}, fmt.Errorf("raw JetStream stream %s: %w", sc.Name, err)
		}
		b.rawStreams = append(b.rawStreams, sc)
	}
	return consumer.CachedInfo().Config, nil
}

// shardConsumer is the name of the consumer of shard n of a type's
// message stream, and of raw JetStream's.
func shardConsumer(n int) string { return "shard-" + strconv.Itoa(n) }

// pullRaw creates raw JetStream's consumers of shards on nc, configured
// as the type's (cfg) but for the raw subjects, and reads each in a
// goroutine of its own as a region reads its shards': pull, count, ack.
func (b *bench) pullRaw(nc *nats.Conn, cfg jetstream.ConsumerConfig, shards []int) error {
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	for _, shard := range shards {
		cc := cfg
		cc.Name, cc.Durable = "", shardConsumer(shard)
		cc.Description = "shardctl bench: raw JetStream, shard " + strconv.Itoa(shard)
		cc.FilterSubject, cc.FilterSubjects = b.rawShard(shard), nil
		ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
		cons, err := js.CreateConsumer(ctx, b.rawStreams[shard%len(b.rawStreams)].Name, cc)
		cancel()
		if err != nil {
			return fmt.Errorf("raw JetStream consumer of shard %d: %w", shard, err)
		}
		it, err := cons.Messages(jetstream.PullMaxMessages(rawPullBatch))
		if err != nil {
			return err
		}
		b.rawIters = append(b.rawIters, it)
		b.rawPulls.Go(func() { ackAll(it, b.raw.add) })
	}
	return nil
}

// ackAll pulls it until it is closed or its consumer is gone, counting
// each message with add and acknowledging it (the raw sides' consumers).
func ackAll(it jetstream.MessagesContext, add func()) {
	for {
		m, err := it.Next()
		switch {
		case errors.Is(err, jetstream.ErrMsgIteratorClosed), errors.Is(err, jetstream.ErrConsumerDeleted), errors.Is(err, jetstream.ErrConsumerNotFound):
			return
		case err != nil:
			continue
		}
		add()
		_ = m.Ack()
	}
}

// close stops raw JetStream's consumers and deletes its stream. The
// connections are the system's.
func (b *bench) close() {
	b.closeBest()
	for _, it := range b.rawIters {
		it.Stop()
	}
	b.rawPulls.Wait()
	for _, sc := range b.rawStreams {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.Timeout)
		_ = b.sys.js.DeleteStream(ctx, sc.Name)
		cancel()
	}
}

func (b *bench) rawShard(shard int) string {
	return rawPrefix + "." + b.sys.cfg.Type + "." + strconv.Itoa(shard) + ".>"
}

func (b *bench) rawEntity(shard int, id string) string {
	return rawPrefix + "." + b.sys.cfg.Type + "." + strconv.Itoa(shard) + "." + id
}

// onRaw is the raw side's subscriber and responder.
func (b *bench) onRaw(m *nats.Msg) {
	if m.Reply != "" {
		_ = m.Respond(m.Data)
	}
	b.raw.add()
}
