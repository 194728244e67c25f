package kvstate

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// Defaults of StreamOptions.
const (
	// DefaultMaxAckPending bounds the messages of one shard delivered to
	// its owner and not acknowledged yet.
	DefaultMaxAckPending = 1000
	// defaultAckWait is long: the only consumer of a shard is its owner,
	// and a new owner replaces the consumer, so a redelivery after AckWait
	// would only hand the same owner a message it is still handling.
	defaultAckWait = 5 * time.Minute
	// streamDuplicates is the stream's de-duplication window
	// (Nats-Msg-Id), as the buffer's.
	streamDuplicates = 2 * time.Minute
)

// StreamOptions configure OpenStream.
type StreamOptions struct {
	Replicas      int           // of the stream and its consumers; 0 means 1
	MaxAckPending int           // per shard; 0 means DefaultMaxAckPending
	Timeout       time.Duration // per operation when ctx has none; 0 means 5s
	// MaxBytes of the stream when it is created (a reservation in the
	// JetStream store, see space.go); 0 or less: no limit. With DiscardNew:
	// a full stream refuses new messages (the publisher's acknowledgement
	// says "maximum bytes exceeded", ErrNoSpace), never drops acknowledged
	// ones. An existing stream keeps its own.
	MaxBytes int64
	// Shards of the type: the stream has a consumer per shard, so an
	// existing stream that allows fewer is reported (Logger).
	Shards int
	// Logger, when set, gets a warning when the stream has no byte limit,
	// or too little room for consumers.
	Logger *slog.Logger
}

// MessageStream is the name of the message stream of type typ (durable
// delivery).
func MessageStream(typ string) string { return "natshard_msgs_" + typ }

// ReminderStream is the name of the reminders' stream of type typ
// (durable delivery).
func ReminderStream(typ string) string { return "natshard_remind_" + typ }

// Stream is the message stream of a type in durable delivery: every
// message sent to the type's entities (its data subjects,
// protocol.Subjects.AllData) is stored in it before any region takes it,
// and leaves it when it is acknowledged (work-queue retention): a region
// acknowledges a message once its entity handled it.
//
// Each shard is read through a durable consumer of its own ("shard-<n>",
// filtered on the shard's subjects, explicit acknowledgements, its state
// stored in memory), which only the shard's owner pulls from. A new owner replaces the consumer
// (ResetConsumer): the new one starts at the first message of the shard
// still in the stream, so what the previous owner had not acknowledged (it
// crashed) is delivered again at once, not after an AckWait. A work-queue
// stream refuses two consumers of one shard, so the replacement also
// cuts a previous owner that is still pulling.
//
// The stream's size is bounded by StreamOptions.MaxBytes with DiscardNew:
// a full stream refuses new messages (the publisher's acknowledgement
// says so, ErrNoSpace) instead of dropping acknowledged ones, and cannot
// take the space of the type's KV bucket.
//
// The entities' reminders (Remind) are JetStream message schedules
// (server 2.12 and later) in a stream of their own, natshard_remind_<type>
// (schedules cannot live in a stream that discards new messages). When
// one is due, the server stores its message there on the entity's fired
// subject (protocol.Subjects.Fired) and removes the schedule; the message
// stream sources the fired messages onto the entities' data subjects,
// where the shard's owner consumes them like any other message, in the
// same sequence space (so State applies a reminder once).
type Stream struct {
	js        jetstream.JetStream
	subjects  protocol.Subjects
	opts      StreamOptions
	name      string
	reminders string // the reminders' stream
	schedules bool   // the server schedules messages in it
}

// OpenStream creates or binds the message stream of the type of subjects.
// An existing stream is bound as it is (its replicas win over opts); it
// must be a work-queue stream of the type's data subjects, otherwise
// OpenStream fails with ErrConfigMismatch.
func OpenStream(ctx context.Context, js jetstream.JetStream, subjects protocol.Subjects, opts StreamOptions) (*Stream, error) {
	if js == nil {
		return nil, errors.New("kvstate: OpenStream with nil JetStream")
	}
	if subjects.Type() == "" {
		return nil, errors.New("kvstate: OpenStream with zero Subjects")
	}
	if opts.Replicas < 0 || opts.Replicas > 5 {
		return nil, fmt.Errorf("kvstate: %d replicas; use 1 to 5 (0 means 1)", opts.Replicas)
	}
	if opts.Replicas == 0 {
		opts.Replicas = 1
	}
	if opts.MaxAckPending <= 0 {
		opts.MaxAckPending = DefaultMaxAckPending
	}
	if opts.Timeout <= 0 {
		opts.Timeout = defaultTimeout
	}
	s := &Stream{js: js, subjects: subjects, opts: opts, name: MessageStream(subjects.Type()), reminders: ReminderStream(subjects.Type())}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	// The reminders' stream first: the message stream sources it.
	remind, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        s.reminders,
		Description: "natshard reminders of type " + subjects.Type() + " (durable delivery)",
		Subjects:    []string{subjects.AllReminders(), subjects.AllFired()},
		// Work queue: a fired reminder leaves once the message stream
		// sourced it; the schedules, which nothing consumes, stay until
		// they fire (the server then removes them) or are cancelled.
		Retention:  jetstream.WorkQueuePolicy,
		Storage:    jetstream.FileStorage,
		Replicas:   opts.Replicas,
		Duplicates: streamDuplicates,
		// Message schedules need roll-ups and discard old; with no size
		// limit there is nothing to discard.
		AllowMsgSchedules: true,
		AllowRollup:       true,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || errors.Is(err, jetstream.ErrStreamNotFound) {
		remind, err = lookupStream(ctx, js, s.reminders)
	}
	if err != nil {
		return nil, translate(fmt.Errorf("open reminder stream %s: %w", s.reminders, err), ErrConflict)
	}
	// A server older than 2.12 ignores the setting: its stream would keep
	// the schedules and never send them (Remind says so).
	s.schedules = remind.CachedInfo().Config.AllowMsgSchedules
	stream, err := createStream(ctx, js, jetstream.StreamConfig{
		Name:        s.name,
		Description: "natshard messages of type " + subjects.Type() + " (durable delivery)",
		Subjects:    []string{subjects.AllData()},
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     jetstream.FileStorage,
		Replicas:    opts.Replicas,
		Duplicates:  streamDuplicates,
		Discard:     jetstream.DiscardNew,
		MaxBytes:    max(opts.MaxBytes, -1),
		// Fired reminders, on the entities' subjects.
		Sources: []*jetstream.StreamSource{{
			Name:              s.reminders,
			SubjectTransforms: []jetstream.SubjectTransformConfig{{Source: subjects.AllFired(), Destination: subjects.AllData()}},
		}},
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || errors.Is(err, jetstream.ErrStreamNotFound) {
		stream, err = lookupStream(ctx, js, s.name)
		if err == nil {
			cfg := stream.CachedInfo().Config
			if !slices.Contains(cfg.Subjects, subjects.AllData()) || cfg.Retention != jetstream.WorkQueuePolicy {
				return nil, fmt.Errorf("%w: stream %s has subjects %q and retention %s, not %q and work queue",
					ErrConfigMismatch, s.name, cfg.Subjects, cfg.Retention, subjects.AllData())
			}
		}
	}
	if err != nil {
		return nil, translate(fmt.Errorf("open message stream %s: %w", s.name, err), ErrConflict)
	}
	warnConsumerRoom(ctx, js, opts.Logger, stream.CachedInfo(), opts.Shards)
	if stream.CachedInfo().Config.MaxBytes <= 0 && opts.Logger != nil {
		opts.Logger.Warn("the type's message stream has no byte limit: a full JetStream store would stop the type's leases (docs/OPERATIONS.md, Storage); set one with nats stream edit --max-bytes",
			"stream", s.name)
	}
	return s, nil
}

// ErrNoSchedules: the NATS server does not schedule messages (it is older
// than 2.12), so the stream cannot keep reminders.
var ErrNoSchedules = errors.New("kvstate: the NATS server does not schedule messages (reminders need nats-server 2.12 or later)")

// Remind stores the reminder name of entity id in shard: at (or at once
// if at has passed) the server stores a message with data on the entity's
// data subject, with the header protocol.HeaderReminder set to name, and
// the shard's owner delivers it. A reminder of the same name replaces the
// entity's earlier one (a roll-up of its subject). The same reminder again
// (name, time and data: a message handled again after a crash sets it
// again) within the stream's de-duplication window is stored once, even
// if it came already: it carries a Nats-Msg-Id made of all three. It
// returns once the stream stored the reminder.
func (s *Stream) Remind(ctx context.Context, shard int, id, name string, at time.Time, data []byte) error {
	subject, err := s.reminder(shard, id, name)
	if err != nil {
		return err
	}
	if !s.schedules {
		return ErrNoSchedules
	}
	m := nats.NewMsg(subject)
	m.Data = data
	m.Header.Set(jsSchedule, "@at "+at.UTC().Format(time.RFC3339Nano))
	m.Header.Set(jsScheduleTarget, s.subjects.Fired(shard, id))
	m.Header.Set(hdrRollup, rollupSubject)
	m.Header.Set(protocol.HeaderReminder, name)
	sum := sha256.Sum256(data)
	m.Header.Set(protocol.HeaderMsgID, fmt.Sprintf("%s@%d#%x", subject, at.UnixNano(), sum[:8]))
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.js.PublishMsg(ctx, m); err != nil {
		return translate(fmt.Errorf("store reminder %q of entity %q: %w", name, id, err), ErrConflict)
	}
	return nil
}

// CancelReminder removes the reminder name of entity id in shard, if it
// is still to come.
func (s *Stream) CancelReminder(ctx context.Context, shard int, id, name string) error {
	subject, err := s.reminder(shard, id, name)
	if err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.js.Stream(ctx, s.reminders)
	if err == nil {
		err = st.Purge(ctx, jetstream.WithPurgeSubject(subject))
	}
	if err != nil {
		return translate(fmt.Errorf("cancel reminder %q of entity %q: %w", name, id, err), ErrConflict)
	}
	return nil
}

// Headers of JetStream message schedules (ADR-51).
const (
	jsSchedule       = "Nats-Schedule"
	jsScheduleTarget = "Nats-Schedule-Target"
)

func (s *Stream) reminder(shard int, id, name string) (string, error) {
	if err := checkShard(shard); err != nil {
		return "", err
	}
	if err := checkEntityID(id); err != nil {
		return "", err
	}
	if err := protocol.ValidateName("reminder name", name); err != nil {
		return "", err
	}
	return s.subjects.Reminder(shard, name, id), nil
}

// Name is the stream's name.
func (s *Stream) Name() string { return s.name }

func (s *Stream) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.Timeout)
}

func consumerName(shard int) string { return "shard-" + strconv.Itoa(shard) }

// ResetConsumer replaces the consumer of shard with a new one that
// delivers, from the start, every message of the shard still in the
// stream: the shard's new owner calls it before it pulls.
//
// The consumer keeps its state (what it delivered, what was acknowledged)
// in memory: a file-stored consumer writes it to its file up to ten times
// a second, and with a consumer per shard those writes were half of the
// server's CPU (docs/BENCHMARKS.md). Nothing needs that state after a
// restart: an acknowledged message has left the work queue, and a
// consumer that lost its state (its servers restarted; a server of a
// cluster recreates it empty) delivers from the first message of the
// shard still in the stream, as a replaced one does. Its owner replaces
// it at once after such a restart: its connection dropped, or its next
// delivery does not have the next consumer sequence, or, when the
// consumer is gone and no pull is waiting (its heartbeats stop), the
// owner finds it gone (docs/PROTOCOL.md, "Durable delivery").
func (s *Stream) ResetConsumer(ctx context.Context, shard int) (jetstream.Consumer, error) {
	if err := checkShard(shard); err != nil {
		return nil, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	name := consumerName(shard)
	if err := s.js.DeleteConsumer(ctx, s.name, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, translate(fmt.Errorf("replace the consumer of shard %d: %w", shard, err), ErrConflict)
	}
	for try := 0; ; try++ {
		c, err := s.createConsumer(ctx, shard, name)
		if err != nil {
			return nil, err
		}
		// Where the new consumer starts is chosen by its first leader,
		// from that server's copy of the stream (nats-server 2.15 defers
		// the choice to the first leader election): a copy that is
		// behind, or was reset (a store that filled, a server that came
		// back), can make it start past messages the stream holds, which
		// it would then never deliver (docs/FAULTS.md, the durable loss
		// of issue 30). The stream's leader says where the shard's
		// messages begin; a consumer that starts later is made again.
		// (A message the stream's leader still holds though it was
		// handled, its removal lost with the consumer that acknowledged
		// it, also looks so: after three tries the consumer is taken, and
		// the region's check of its first delivery has the last word.)
		skipped, err := s.StartsLate(ctx, shard, c.CachedInfo().Delivered.Stream+1)
		if err != nil || !skipped || try == 2 {
			return c, nil
		}
		if err := s.js.DeleteConsumer(ctx, s.name, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, translate(fmt.Errorf("replace the consumer of shard %d: %w", shard, err), ErrConflict)
		}
		if !wait.Sleep(ctx, 100*time.Millisecond*time.Duration(try+1)) {
			return nil, fmt.Errorf("%w: replace the consumer of shard %d: %w", ErrUnavailable, shard, ctx.Err())
		}
	}
}

// StartsLate reports whether a consumer of shard whose next delivery is
// stream sequence next skips messages: the stream's leader holds a
// message of the shard below next. (A message acknowledged and removed
// meanwhile does not count: it was handled.)
func (s *Stream) StartsLate(ctx context.Context, shard int, next uint64) (bool, error) {
	first, err := s.FirstOf(ctx, shard)
	if err != nil {
		return false, err
	}
	return first != 0 && first < next, nil
}

// FirstOf returns the stream sequence of the first message of shard the
// stream holds, as its leader says (not a replica that may be behind);
// 0 when it holds none.
func (s *Stream) FirstOf(ctx context.Context, shard int) (uint64, error) {
	if err := checkShard(shard); err != nil {
		return 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	req, err := json.Marshal(struct {
		Seq  uint64 `json:"seq"`
		Next string `json:"next_by_subj"`
	}{1, s.subjects.Shard(shard)})
	if err != nil {
		return 0, err
	}
	m, err := msgGet(ctx, s.js.Conn(), apiPrefix(s.js)+"STREAM.MSG.GET."+s.name, req)
	if apiCode(err) == codeNoMessage {
		return 0, nil
	}
	if err != nil {
		return 0, translate(fmt.Errorf("read the first message of shard %d: %w", shard, err), ErrConflict)
	}
	return m.Sequence, nil
}

// createConsumer makes the consumer of shard (name: consumerName).
func (s *Stream) createConsumer(ctx context.Context, shard int, name string) (jetstream.Consumer, error) {
	c, err := s.js.CreateConsumer(ctx, s.name, jetstream.ConsumerConfig{
		Durable:       name,
		Description:   "natshard: shard " + strconv.Itoa(shard) + " of type " + s.subjects.Type() + ", pulled by its owner",
		FilterSubject: s.subjects.Shard(shard),
		AckPolicy:     jetstream.AckExplicitPolicy,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckWait:       defaultAckWait,
		MaxAckPending: s.opts.MaxAckPending,
		Replicas:      s.opts.Replicas,
		// Its state (what it delivered, what was acknowledged) is kept in
		// memory, not written to a file up to ten times a second: the
		// work queue already keeps what matters (an acknowledged message
		// is removed), and a consumer that loses its state (its servers
		// restarted) starts again at the first message of the shard still
		// in the stream, as a replaced one does. See ResetConsumer's doc.
		MemoryStorage: true,
	})
	if err != nil {
		return nil, translate(fmt.Errorf("create the consumer of shard %d: %w", shard, err), ErrConflict)
	}
	return c, nil
}

// Pending returns how many messages of shard the stream holds: not yet
// handled (or handled and not yet acknowledged).
func (s *Stream) Pending(ctx context.Context, shard int) (uint64, error) {
	if err := checkShard(shard); err != nil {
		return 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name)
	if err != nil {
		return 0, translate(err, ErrConflict)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(s.subjects.Shard(shard)))
	if err != nil {
		return 0, translate(err, ErrConflict)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}

// WaitRemoved returns once the stream no longer holds message seq, or
// with ctx's error. An acknowledgement confirmed by the consumer
// (DoubleAck) removes its message from a replicated work-queue stream
// only once the stream's leader applied the removal, a moment later; a
// consumer made meanwhile would deliver the message again. Removals come
// in the order of the acknowledgements, so once seq is gone every message
// acknowledged before it is too.
func (s *Stream) WaitRemoved(ctx context.Context, seq uint64) error {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name)
	if err != nil {
		return translate(err, ErrConflict)
	}
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		_, err := st.GetMsg(ctx, seq) // from the stream leader
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			return nil
		case err != nil && ctx.Err() != nil:
			return translate(fmt.Errorf("wait for the removal of message %d: %w", seq, err), ErrConflict)
		}
		select {
		case <-ctx.Done():
			return translate(fmt.Errorf("wait for the removal of message %d: %w", seq, ctx.Err()), ErrConflict)
		case <-time.After(wait):
		}
	}
}

// Messages returns how many messages the stream holds: not yet handled
// and acknowledged.
func (s *Stream) Messages(ctx context.Context) (uint64, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name)
	if err != nil {
		return 0, translate(err, ErrConflict)
	}
	return st.CachedInfo().State.Msgs, nil
}

// PublishOnce stores m in the message stream that captures its subject
// (a type of durable delivery) and returns its stream sequence once the
// stream acknowledged it: stored, and replicated on a cluster; and
// whether the stream dropped m as a duplicate: a message with its
// Nats-Msg-Id was stored within the stream's duplicate window (seq is
// then that message's). Errors: ErrNoSpace when the stream is at its max
// bytes or the store is full (the message was not stored),
// ErrUnavailable when JetStream did not answer or has no stream leader (a
// new attempt with the same Nats-Msg-Id stores the message once), and as
// translate leaves them.
func PublishOnce(ctx context.Context, js jetstream.JetStream, m *nats.Msg) (seq uint64, duplicate bool, _ error) {
	ack, err := js.PublishMsg(ctx, m)
	if err != nil {
		return 0, false, translate(fmt.Errorf("publish %s: %w", m.Subject, err), ErrConflict)
	}
	return ack.Sequence, ack.Duplicate, nil
}
