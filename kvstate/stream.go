package kvstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
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
	Replicas      int           // of the streams and their consumers; 0 means 1
	MaxAckPending int           // per shard; 0 means DefaultMaxAckPending
	Timeout       time.Duration // per operation when ctx has none; 0 means 5s
	// MaxBytes of the type's message streams together when they are
	// created (a reservation in the JetStream store, see space.go), split
	// evenly over them (Streams); 0 or less: no limit. With DiscardNew: a
	// full stream refuses new messages (the publisher's acknowledgement
	// says "maximum bytes exceeded", ErrNoSpace), never drops acknowledged
	// ones. Each stream fills on its own: one whose shards get more than
	// their share is refused first. An existing stream keeps its own.
	MaxBytes int64
	// Streams is how many message streams the type's messages are split
	// over (protocol.TypeConfig.Streams, chosen by MessageStreamsFor when
	// the type was made); 0 or 1: the single stream MessageStream.
	Streams int
	// Shards of the type: the highest count of its layout (a split's
	// target while one runs). With Streams > 1 the streams capture the
	// subjects of these shards (Extend adds a split's children); each
	// stream has a consumer per shard of its own, so an existing stream
	// that allows fewer is reported (Logger).
	Shards int
	// Logger, when set, gets a warning when a stream has no byte limit,
	// or too little room for consumers.
	Logger *slog.Logger
	// Lock, when set, is held while the streams' subjects are updated
	// (Store.LockStreams): every process of the type must pass it. Two
	// processes updating a stream at once can make nats-server store each
	// message on the added subjects twice.
	Lock func(ctx context.Context) (unlock func(), err error)
}

// MaxMessageStreams bounds how many message streams a type's messages are
// split over (MessageStreamsFor).
const MaxMessageStreams = 16

// MessageStreamsFor is how many message streams a durable type of first
// shard count n is given: the largest divisor of n that is at most
// MaxMessageStreams. As every later count of the type is a multiple of
// its first (a split multiplies it, and the children of shard s among N
// are s + j*N), shard s and all its ancestors and descendants are in the
// same stream, s mod k: an entity's stream never changes.
func MessageStreamsFor(n int) int {
	for k := min(n, MaxMessageStreams); k > 1; k-- {
		if n%k == 0 {
			return k
		}
	}
	return 1
}

// MessageStream is the name of the single message stream of type typ
// (durable delivery with one stream: a type whose configuration has no
// Streams, made before the split, or whose first count has no divisor
// from 2 to MaxMessageStreams).
func MessageStream(typ string) string { return "natshard_msgs_" + typ }

// MessageStreams are the names of the k message streams of type typ,
// by index: shard s is in stream s mod k. For k > 1 stream i is
// natshard_msgs_<type>~<i>: '~' is no character of a type's name, so no
// type's stream can have another type's name.
func MessageStreams(typ string, k int) []string {
	if k <= 1 {
		return []string{MessageStream(typ)}
	}
	names := make([]string, k)
	for i := range names {
		names[i] = MessageStream(typ) + "~" + strconv.Itoa(i)
	}
	return names
}

// AllMessageStreams are the names a message stream of type typ may have:
// the single stream, and the streams of every k up to MaxMessageStreams
// (natshard_msgs_<type>~0 to ~15). Permissions name them all.
func AllMessageStreams(typ string) []string {
	return append([]string{MessageStream(typ)}, MessageStreams(typ, MaxMessageStreams)...)
}

// ReminderStream is the name of the reminders' stream of type typ
// (durable delivery).
func ReminderStream(typ string) string { return "natshard_remind_" + typ }

// Stream is the message stream of a type in durable delivery: every
// message sent to the type's entities (its data subjects,
// protocol.Subjects.AllData) is stored in it before any region takes it,
// and leaves it when it is acknowledged (work-queue retention): a region
// acknowledges a message once its entity handled it.
//
// The stream is in fact k streams (StreamOptions.Streams, MessageStreams):
// shard s is in stream s mod k, which captures the subjects of its own
// shards (an explicit list: no wildcard selects "s mod k"); k = 1 is a
// single stream of every data subject. Split so, nats-server finds a
// shard's next message among a k-th of the type's messages, and checks a
// k-th of the consumers at each acknowledgement (docs/PROTOCOL.md, "The
// consumers' shape"). A split of the type adds its children's subjects to
// their stream (Extend) before anything is published on them.
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
// subject (protocol.Subjects.Fired; with several message streams
// Subjects.FiredIn, which names the shard's stream) and removes the
// schedule; the message stream sources the fired messages (each of
// several streams those of its own shards, Subjects.FiredPart, through
// one source that never changes) onto their data subjects, where the
// shard's owner consumes them like any other message, in the same
// sequence space (so State applies a reminder once).
type Stream struct {
	js        jetstream.JetStream
	subjects  protocol.Subjects
	opts      StreamOptions
	names     []string // the message streams, by index (shard mod len)
	reminders string   // the reminders' stream
	schedules bool     // the server schedules messages in it
	extendMu  sync.Mutex
	covered   int // Extend: the shard count the streams are known to capture
}

// OpenStream creates or binds the message streams of the type of subjects.
// An existing stream is bound as it is (its replicas win over opts); it
// must be a work-queue stream of the type's data subjects (with several
// streams: of its own shards' subjects, to which those of the shards
// below opts.Shards it lacks are added), otherwise OpenStream fails with
// ErrConfigMismatch. A type's single stream MessageStream that exists is
// bound whatever opts.Streams says (a type made before the split).
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
	if opts.Streams < 0 || opts.Streams > MaxMessageStreams {
		return nil, fmt.Errorf("kvstate: %d message streams; a type has 1 to %d (0 means 1)", opts.Streams, MaxMessageStreams)
	}
	if opts.Streams > 1 && (opts.Shards < 1 || opts.Shards%opts.Streams != 0) {
		return nil, fmt.Errorf("kvstate: %d shards cannot be split over %d message streams: a type's counts are multiples of its first, which the streams divide", opts.Shards, opts.Streams)
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
	s := &Stream{js: js, subjects: subjects, opts: opts, reminders: ReminderStream(subjects.Type())}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	// The reminders' stream first: the message streams source it.
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
	k := max(opts.Streams, 1)
	if k > 1 {
		// A type's single stream, if it has one, is kept: its messages
		// stay where they are.
		_, err := js.Stream(ctx, MessageStream(subjects.Type()))
		switch {
		case err == nil:
			if opts.Logger != nil {
				opts.Logger.Info("the type has a single message stream: its messages stay in it, not split over the streams its configuration names",
					"stream", MessageStream(subjects.Type()), "streams", k)
			}
			k = 1
		case !errors.Is(err, jetstream.ErrStreamNotFound):
			return nil, translate(fmt.Errorf("look for message stream %s: %w", MessageStream(subjects.Type()), err), ErrConflict)
		}
	}
	s.names = MessageStreams(subjects.Type(), k)
	s.opts.Streams = k
	if k == 1 {
		if err := s.openSingle(ctx); err != nil {
			return nil, err
		}
		return s, nil
	}
	for i := range s.names {
		if err := s.openPart(ctx, i); err != nil {
			return nil, err
		}
	}
	s.covered = opts.Shards
	return s, nil
}

// openSingle creates or binds the single message stream (k = 1).
func (s *Stream) openSingle(ctx context.Context) error {
	name, subjects, opts := s.names[0], s.subjects, s.opts
	stream, err := createStream(ctx, s.js, jetstream.StreamConfig{
		Name:        name,
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
		stream, err = lookupStream(ctx, s.js, name)
		if err == nil {
			cfg := stream.CachedInfo().Config
			if !slices.Contains(cfg.Subjects, subjects.AllData()) || cfg.Retention != jetstream.WorkQueuePolicy {
				return fmt.Errorf("%w: stream %s has subjects %q and retention %s, not %q and work queue",
					ErrConfigMismatch, name, cfg.Subjects, cfg.Retention, subjects.AllData())
			}
		}
	}
	if err != nil {
		return translate(fmt.Errorf("open message stream %s: %w", name, err), ErrConflict)
	}
	s.warn(ctx, stream.CachedInfo(), opts.Shards)
	return nil
}

// warn says when the stream of info may refuse the consumers of shards
// shards, or has no byte limit.
func (s *Stream) warn(ctx context.Context, info *jetstream.StreamInfo, shards int) {
	warnConsumerRoom(ctx, s.js, s.opts.Logger, info, shards)
	if info.Config.MaxBytes <= 0 && s.opts.Logger != nil {
		s.opts.Logger.Warn("the type's message stream has no byte limit: a full JetStream store would stop the type's leases (docs/OPERATIONS.md, Storage); set one with nats stream edit --max-bytes",
			"stream", info.Config.Name)
	}
}

// partConfig is the configuration of message stream i of k > 1 made for
// n shards: the data subjects of its shards (s = i mod k) below n, and a
// source of the reminders' stream taking its shards' fired reminders
// (Subjects.FiredPart: Remind stores them so) onto their data subjects.
// The source never changes at a split (Extend adds subjects only): the
// server would take a changed source, or a second source of the same
// stream, for a new one, and deliver again what the old one had taken
// (or leave it in the work queue).
func (s *Stream) partConfig(i, n int) jetstream.StreamConfig {
	k := len(s.names)
	var subjects []string
	for sh := i; sh < n; sh += k {
		subjects = append(subjects, s.subjects.Shard(sh))
	}
	maxBytes := int64(-1)
	if s.opts.MaxBytes > 0 {
		maxBytes = max(s.opts.MaxBytes/int64(k), 1)
	}
	return jetstream.StreamConfig{
		Name:        s.names[i],
		Description: fmt.Sprintf("natshard messages of type %s, shards %d mod %d (durable delivery)", s.subjects.Type(), i, k),
		Subjects:    subjects,
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     jetstream.FileStorage,
		Replicas:    s.opts.Replicas,
		Duplicates:  streamDuplicates,
		Discard:     jetstream.DiscardNew,
		MaxBytes:    maxBytes,
		Sources: []*jetstream.StreamSource{{
			Name: s.reminders,
			SubjectTransforms: []jetstream.SubjectTransformConfig{{
				Source:      s.subjects.FiredPart(i),
				Destination: strings.TrimSuffix(s.subjects.AllData(), ">") + "{{wildcard(1)}}.>",
			}},
		}},
	}
}

// openPart creates or binds message stream i (of k > 1) for the shards
// below opts.Shards.
func (s *Stream) openPart(ctx context.Context, i int) error {
	want := s.partConfig(i, s.opts.Shards)
	stream, err := createStream(ctx, s.js, want)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || errors.Is(err, jetstream.ErrStreamNotFound) {
		stream, err = lookupStream(ctx, s.js, want.Name)
		if err == nil {
			err = s.checkPart(i, stream.CachedInfo().Config)
		}
		if err == nil && s.lacks(stream.CachedInfo().Config, i, s.opts.Shards) {
			err = s.locked(ctx, func() error {
				stream, err = s.extendPart(ctx, i, s.opts.Shards)
				return err
			})
		}
	}
	if err != nil {
		return translate(fmt.Errorf("open message stream %s: %w", want.Name, err), ErrConflict)
	}
	s.warn(ctx, stream.CachedInfo(), s.opts.Shards/len(s.names))
	return nil
}

// checkPart: an existing message stream i must be a work queue of data
// subjects of its own shards (i mod k).
func (s *Stream) checkPart(i int, cfg jetstream.StreamConfig) error {
	k := len(s.names)
	if cfg.Retention != jetstream.WorkQueuePolicy {
		return fmt.Errorf("%w: stream %s has retention %s, not work queue", ErrConfigMismatch, cfg.Name, cfg.Retention)
	}
	for _, subj := range cfg.Subjects {
		sh, ok := s.shardOfSubject(subj)
		if !ok || sh%k != i {
			return fmt.Errorf("%w: stream %s has subject %q, not one of %s for shards %d mod %d",
				ErrConfigMismatch, cfg.Name, subj, s.subjects.Shard(i), i, k)
		}
	}
	return nil
}

// shardOfSubject returns the shard whose subscription subject (Shard) subj
// is.
func (s *Stream) shardOfSubject(subj string) (int, bool) {
	rest, ok := strings.CutPrefix(subj, strings.TrimSuffix(s.subjects.AllData(), ">"))
	if !ok {
		return 0, false
	}
	num, ok := strings.CutSuffix(rest, ".>")
	if !ok {
		return 0, false
	}
	sh, err := strconv.Atoi(num)
	if err != nil || sh < 0 || s.subjects.Shard(sh) != subj {
		return 0, false
	}
	return sh, true
}

// lacks reports whether the configuration cfg of message stream i lacks
// a subject of its shards below n.
func (s *Stream) lacks(cfg jetstream.StreamConfig, i, n int) bool {
	has := make(map[string]bool, len(cfg.Subjects)) // up to 4 096 (MaxShards / 16)
	for _, subj := range cfg.Subjects {
		has[subj] = true
	}
	for sh := i; sh < n; sh += len(s.names) {
		if !has[s.subjects.Shard(sh)] {
			return true
		}
	}
	return false
}

// locked runs update holding StreamOptions.Lock, if there is one.
func (s *Stream) locked(ctx context.Context, update func() error) error {
	if s.opts.Lock == nil {
		return update()
	}
	unlock, err := s.opts.Lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	return update()
}

// extendPart adds to message stream i the subjects of its shards below n
// that it lacks, keeping the rest of its configuration (an operator's
// edits, its source) as it is, and returns the stream once its
// configuration has them all. The configuration is computed from the
// stream's, so processes doing it at once write the same one.
func (s *Stream) extendPart(ctx context.Context, i, n int) (jetstream.Stream, error) {
	want := s.partConfig(i, n)
	for try := 0; ; try++ {
		st, err := s.js.Stream(ctx, want.Name)
		if err != nil {
			return nil, err
		}
		cfg := st.CachedInfo().Config
		has := make(map[string]bool, len(cfg.Subjects))
		for _, subj := range cfg.Subjects {
			has[subj] = true
		}
		missing := false
		for _, subj := range want.Subjects {
			if !has[subj] {
				cfg.Subjects = append(cfg.Subjects, subj)
				missing = true
			}
		}
		if !missing {
			return st, nil
		}
		if try == 3 {
			return nil, fmt.Errorf("%w: stream %s still lacks the subjects of its shards below %d after %d updates", ErrUnavailable, want.Name, n, try)
		}
		// Checked again: the update of another process at the same time
		// may have been taken instead.
		if _, err := s.js.UpdateStream(ctx, cfg); err != nil {
			return nil, fmt.Errorf("add the subjects of shards below %d: %w", n, err)
		}
	}
}

// Extend makes the message streams capture the subjects of shards below
// n (and take their fired reminders): a split to n shards calls it before
// anything is published on the new shards' subjects, that is before any
// region forwards to a child and before publishers learn the count; a
// message on a shard no stream captures is refused. It is idempotent:
// each stream's new configuration is its own plus what it lacks, the same
// from every process, made while holding StreamOptions.Lock. With a single
// stream (k = 1) there is nothing to do.
func (s *Stream) Extend(ctx context.Context, n int) error {
	if len(s.names) == 1 {
		return nil
	}
	if n < 1 || n > protocol.MaxShards || n%len(s.names) != 0 {
		return fmt.Errorf("kvstate: %d shards cannot be split over %d message streams", n, len(s.names))
	}
	s.extendMu.Lock()
	defer s.extendMu.Unlock()
	if n <= s.covered {
		return nil
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	// Most often another region did it already: no lock then.
	var lacking []int
	for i, name := range s.names {
		st, err := s.js.Stream(ctx, name)
		if err != nil {
			return translate(fmt.Errorf("extend message stream %s to %d shards: %w", name, n, err), ErrConflict)
		}
		if s.lacks(st.CachedInfo().Config, i, n) {
			lacking = append(lacking, i)
		}
	}
	if len(lacking) > 0 {
		err := s.locked(ctx, func() error {
			for _, i := range lacking {
				if _, err := s.extendPart(ctx, i, n); err != nil {
					return fmt.Errorf("extend message stream %s to %d shards: %w", s.names[i], n, err)
				}
			}
			return nil
		})
		if err != nil {
			return translate(err, ErrConflict)
		}
	}
	s.covered = n
	return nil
}

// Names are the names of the message streams, by index: shard s is in
// the stream s mod len(Names()).
func (s *Stream) Names() []string { return slices.Clone(s.names) }

// StreamOf is the name of the message stream of shard.
func (s *Stream) StreamOf(shard int) string { return s.names[shard%len(s.names)] }

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
	name, stream := consumerName(shard), s.StreamOf(shard)
	if err := s.js.DeleteConsumer(ctx, stream, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
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
		if err := s.js.DeleteConsumer(ctx, stream, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
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
	m, err := msgGet(ctx, s.js.Conn(), apiPrefix(s.js)+"STREAM.MSG.GET."+s.StreamOf(shard), req)
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
	c, err := s.js.CreateConsumer(ctx, s.StreamOf(shard), jetstream.ConsumerConfig{
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
	st, err := s.js.Stream(ctx, s.StreamOf(shard))
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

// WaitRemoved returns once the stream of shard no longer holds message
// seq (a sequence of that stream), or with ctx's error. An acknowledgement confirmed by the consumer
// (DoubleAck) removes its message from a replicated work-queue stream
// only once the stream's leader applied the removal, a moment later; a
// consumer made meanwhile would deliver the message again. Removals come
// in the order of the acknowledgements, so once seq is gone every message
// acknowledged before it is too.
func (s *Stream) WaitRemoved(ctx context.Context, shard int, seq uint64) error {
	if err := checkShard(shard); err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	st, err := s.js.Stream(ctx, s.StreamOf(shard))
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

// Messages returns how many messages the message streams hold together:
// not yet handled and acknowledged.
func (s *Stream) Messages(ctx context.Context) (uint64, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	var n uint64
	for _, name := range s.names {
		st, err := s.js.Stream(ctx, name)
		if err != nil {
			return 0, translate(err, ErrConflict)
		}
		n += st.CachedInfo().State.Msgs
	}
	return n, nil
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
