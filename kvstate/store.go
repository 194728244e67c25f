package kvstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// markerTTL is the bucket's LimitMarkerTTL: how long the marker that the
// server writes when a key's TTL runs out stays in the bucket (it also
// enables per-key TTLs at all). The marker is how a watcher learns that a
// lease expired. A watcher is an ordered consumer; when it is reset (missed
// heartbeats, its server restarted) it resumes at the stream sequence after
// the last one it saw, so a marker written and already gone during the gap
// would be missed, and the watcher would believe in the expired lease
// forever. The marker must therefore outlive any such gap by far: a few
// seconds normally, tens of seconds when a cluster loses a server. Watches
// also end on disconnection (see watch), so a long client outage is not such
// a gap. Five minutes covers that with a wide margin, and markers cost one
// small message per expired key for that long, which is nothing. The same
// TTL is given to the marker that DeleteEntity leaves, so deleted entities
// leave nothing behind for long.
const markerTTL = 5 * time.Minute

// defaultTimeout bounds an operation whose context has no deadline when
// Options.Timeout is 0.
const defaultTimeout = 5 * time.Second

// Headers of KV records. The KV-Operation values are those of nats.go's KV
// implementation, so that its watchers and ours agree on what a tombstone
// is.
const (
	hdrKVOp       = "KV-Operation"
	kvOpDel       = "DEL"
	kvOpPurge     = "PURGE"
	hdrRollup     = "Nats-Rollup"
	rollupSubject = "sub"
	// Atomic batch publish (nats-server stream.go).
	hdrBatchID     = "Nats-Batch-Id"
	hdrBatchSeq    = "Nats-Batch-Sequence"
	hdrBatchCommit = "Nats-Batch-Commit"
)

// Store is the JetStream KV bucket of one entity type. It is safe for
// concurrent use. Every method takes a context first; when the context has
// no deadline, Options.Timeout bounds the call.
type Store struct {
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	bucket string
	opts   Options

	nc         *nats.Conn
	subjPrefix string           // "$KV.<bucket>."
	msgGetSubj string           // "$JS.API.STREAM.MSG.GET.KV_<bucket>": leader reads
	stream     jetstream.Stream // the bucket's stream: STREAM.INFO, answered by the leader

	// space guards the bucket's reserve against entity state (nil: the
	// bucket has no byte limit); spaceLog reports refusals for lack of
	// space.
	space    *budget
	spaceLog *spaceLog

	// fenceMu serializes this Store's writes that are checked against the
	// coordinator key (PutShard, renewing or releasing the coordinator
	// lease). A replicated stream refuses a write checked against a subject
	// that has another write in flight (error 10164, see cas), so two such
	// writes of the same coordinator would otherwise refuse each other.
	fenceMu fenceLock

	// atomicBatches: the bucket's stream takes atomic batches
	// (AllowAtomicPublish), so Batches has batchFrom rows or more go as
	// one (PutShards), or fewer when rows written alone take long.
	atomicBatches atomic.Bool
	batchFrom     int
	// rowTime: how long a row written alone takes, acknowledged (a
	// moving average, nanoseconds; 0 before the first).
	rowTime atomic.Int64
}

// fenceLock is Store.fenceMu: a lock whose writers of the lease itself
// (its renewals and release, a deposition) go before the writes fenced on
// it (shard table, pins): a renewal waits for the write in flight, not
// for a queue of them (a rebalance writes hundreds; on a loaded machine
// such a queue delayed renewals past the lease's deadline, and the
// coordinator stepped down again and again).
type fenceLock struct {
	mu    sync.Mutex
	cond  *sync.Cond // on mu; made on first use
	held  bool
	lease int // writers of the lease waiting
}

func (f *fenceLock) wait() {
	if f.cond == nil {
		f.cond = sync.NewCond(&f.mu)
	}
	f.cond.Wait()
}

// lockFenced takes the lock for a write fenced on the lease, once no
// writer of the lease waits.
func (f *fenceLock) lockFenced() {
	f.mu.Lock()
	for f.held || f.lease > 0 {
		f.wait()
	}
	f.held = true
	f.mu.Unlock()
}

// Lock takes the lock for a write of the lease, before the fenced writes
// that wait.
func (f *fenceLock) Lock() {
	f.mu.Lock()
	f.lease++
	for f.held {
		f.wait()
	}
	f.lease--
	f.held = true
	f.mu.Unlock()
}

// Unlock releases the lock, whoever took it.
func (f *fenceLock) Unlock() {
	f.mu.Lock()
	f.held = false
	if f.cond != nil {
		f.cond.Broadcast()
	}
	f.mu.Unlock()
}

func (f *fenceLock) unlockFenced() { f.Unlock() }

// RegionEntry is a registered region with the revision of its registration.
type RegionEntry struct {
	Info     protocol.RegionInfo
	Revision uint64
}

// RegionEvent is one change of the region registry seen by a watch.
type RegionEvent struct {
	ID       string
	Info     *protocol.RegionInfo // nil when the registration was deleted or expired
	Revision uint64
	Synced   bool // marker: the initial values have all been delivered; other fields empty
}

// CoordinatorEvent is one change of the coordinator lease seen by a watch.
type CoordinatorEvent struct {
	Info     *protocol.CoordinatorInfo // nil when released or expired
	Revision uint64
	Synced   bool
}

// Open creates or binds the bucket of type typ (BucketName) with per-key
// TTLs enabled (LimitMarkerTTL) and history 1.
//
// The bucket is created if it does not exist; if it exists with another
// configuration (for example another replica count) it is bound as it is,
// never updated: processes opening the bucket do not fight over its
// configuration. A bound bucket must have history 1 and per-key TTLs,
// otherwise Open fails with ErrConfigMismatch. A bucket Open creates takes
// atomic batches where the server has them (NATS 2.12 and later;
// PutShards); one made before this version is bound as it is.
func Open(ctx context.Context, js jetstream.JetStream, typ string, opts Options) (*Store, error) {
	return open(ctx, js, typ, opts, true)
}

// Bind binds the existing bucket of type typ without creating it: for
// tools that inspect a type. ErrNotFound when the type has no bucket.
func Bind(ctx context.Context, js jetstream.JetStream, typ string, opts Options) (*Store, error) {
	return open(ctx, js, typ, opts, false)
}

func open(ctx context.Context, js jetstream.JetStream, typ string, opts Options, create bool) (*Store, error) {
	if js == nil {
		return nil, errors.New("kvstate: Open with nil JetStream")
	}
	if err := protocol.ValidateName("type", typ); err != nil {
		return nil, err
	}
	if opts.Replicas < 0 || opts.Replicas > 5 {
		return nil, fmt.Errorf("kvstate: %d replicas; use 1 to 5 (0 means 1)", opts.Replicas)
	}
	if opts.Replicas == 0 {
		opts.Replicas = 1
	}
	if opts.Timeout <= 0 {
		opts.Timeout = defaultTimeout
	}
	bucket := BucketName(typ)
	s := &Store{
		js:         js,
		bucket:     bucket,
		opts:       opts,
		nc:         js.Conn(),
		subjPrefix: "$KV." + bucket + ".",
		msgGetSubj: apiPrefix(js) + "STREAM.MSG.GET.KV_" + bucket,
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()

	var kv jetstream.KeyValue
	var err error = jetstream.ErrBucketExists
	if create {
		err = createBucket(ctx, js, bucketConfig(bucket, typ, opts))
		if err == nil || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) ||
			// A create racing another process's on a cluster (lookupStream).
			errors.Is(err, jetstream.ErrStreamNotFound) {
			err = jetstream.ErrBucketExists
		}
	}
	if errors.Is(err, jetstream.ErrBucketExists) {
		kv, err = js.KeyValue(ctx, bucket)
		for create && errors.Is(err, jetstream.ErrBucketNotFound) && settling(ctx) {
			// Another process is creating it (see lookupStream).
			kv, err = js.KeyValue(ctx, bucket)
		}
		if err == nil {
			err = checkBucket(ctx, kv)
		}
	}
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		if create {
			// Created (by this process or another) and still not found
			// when ctx ended: a cluster electing; another attempt may pass.
			return nil, fmt.Errorf("%w: bucket %s was created but is not found yet: %w", ErrUnavailable, bucket, err)
		}
		return nil, fmt.Errorf("%w: bucket %s: %w", ErrNotFound, bucket, err)
	}
	if err != nil {
		return nil, translate(fmt.Errorf("open bucket %s: %w", bucket, err), ErrConflict)
	}
	s.kv = kv
	if err := s.openBudget(ctx); err != nil {
		return nil, translate(fmt.Errorf("open bucket %s: %w", bucket, err), ErrConflict)
	}
	return s, nil
}

// lookupStream returns the stream name, which exists: this process
// created it, or another's create won the race with its own. On a cluster
// a stream just created may still be "not found" for a moment, to a lookup
// or to a racing create (a shardd of three started at once on a fresh
// cluster failed so, in TestThreeShardd/cluster and TestFullRestart), so
// that is retried until ctx ends (the store's timeout); a stream still not
// found then is ErrUnavailable (another attempt may find it).
func lookupStream(ctx context.Context, js jetstream.JetStream, name string) (jetstream.Stream, error) {
	st, err := js.Stream(ctx, name)
	for errors.Is(err, jetstream.ErrStreamNotFound) && settling(ctx) {
		st, err = js.Stream(ctx, name)
	}
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("%w: stream %s was created but is not found yet: %w", ErrUnavailable, name, err)
	}
	return st, err
}

// settling waits a little before the next lookup of something another
// process has just created; false when ctx ended.
func settling(ctx context.Context) bool { return wait.Sleep(ctx, 50*time.Millisecond) }

// openBudget reads the bucket's byte limit and size, and sets up its
// budget (none without a limit, with a warning) and its log; and whether
// the bucket takes atomic batches.
func (s *Store) openBudget(ctx context.Context) error {
	stream := "KV_" + s.bucket
	st, err := lookupStream(ctx, s.js, stream)
	if err != nil {
		return err
	}
	s.stream = st
	info := st.CachedInfo()
	s.atomicBatches.Store(info.Config.AllowAtomicPublish)
	s.batchFrom = batchFrom(info.Config.Replicas)
	if !info.Config.AllowAtomicPublish && s.opts.Logger != nil {
		s.opts.Logger.Warn("the type's KV bucket takes no atomic batches: the coordinator writes its shard table one row at a time (docs/OPERATIONS.md, Atomic batches)",
			"stream", stream)
	}
	s.spaceLog = newSpaceLog(s.opts.Logger, stream, info.Config.MaxBytes)
	s.space = newBudget(stream, info.Config.MaxBytes, int64(info.State.Bytes), "entity state that adds bytes",
		streamBytes(s.js, stream))
	if s.space == nil && s.opts.Logger != nil {
		s.opts.Logger.Warn("the type's KV bucket has no byte limit: a full JetStream store would stop its leases (docs/OPERATIONS.md, Storage); set one with nats stream edit --max-bytes",
			"stream", stream)
	}
	return nil
}

// bucketConfig is the stream of type typ's bucket: what nats.go's
// CreateKeyValue makes of a KeyValueConfig with history 1, per-key TTLs
// (LimitMarkerTTL) and file storage (prepareKeyValueConfig in
// jetstream/kv.go; TestBucketConfig holds the two together), with atomic
// batches allowed (PutShards), which a KeyValueConfig cannot ask for.
// Processes that create the bucket at once send the same configuration,
// which the server takes as one create; none updates it afterwards (an
// update racing another on a cluster went unanswered for 20 s).
// createBucket leaves out what an older server does not have.
func bucketConfig(bucket, typ string, opts Options) jetstream.StreamConfig {
	maxBytes := opts.MaxBytes
	if maxBytes <= 0 {
		maxBytes = -1
	}
	return jetstream.StreamConfig{
		Name:                   "KV_" + bucket,
		Description:            "natshard state of type " + typ,
		Subjects:               []string{"$KV." + bucket + ".>"},
		MaxMsgsPerSubject:      1,
		MaxBytes:               maxBytes,
		MaxMsgSize:             -1,
		MaxMsgs:                -1,
		MaxConsumers:           -1,
		Storage:                jetstream.FileStorage,
		Replicas:               opts.Replicas,
		AllowRollup:            true,
		DenyDelete:             true,
		Duplicates:             2 * time.Minute,
		AllowDirect:            true,
		Discard:                jetstream.DiscardNew,
		AllowMsgTTL:            true,
		SubjectDeleteMarkerTTL: markerTTL,
		AllowAtomicPublish:     true,
	}
}

// createBucket creates the bucket's stream as cfg says, leaving out what
// the server's JetStream API level does not have: atomic batches before
// level 2 (NATS 2.12; an older server would refuse the field in strict
// mode, or warn of it); and before level 1 (NATS 2.11), with no per-key
// TTLs, it creates nothing and fails, as nats.go's CreateKeyValue does.
func createBucket(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) error {
	info, err := js.AccountInfo(ctx)
	if err != nil {
		return err
	}
	switch {
	case info.API.Level < 1:
		return fmt.Errorf("%w: bucket %s needs per-key TTLs: NATS 2.11 or newer", ErrConfigMismatch, cfg.Name)
	case info.API.Level < 2:
		cfg.AllowAtomicPublish = false
	}
	_, err = js.CreateStream(ctx, cfg)
	return err
}

// checkBucket verifies that an existing bucket can hold leases.
func checkBucket(ctx context.Context, kv jetstream.KeyValue) error {
	st, err := kv.Status(ctx)
	if err != nil {
		return err
	}
	if st.History() != 1 || st.LimitMarkerTTL() <= 0 {
		return fmt.Errorf("%w: bucket %s has history %d and limit marker TTL %v; kvstate needs history 1 and per-key TTLs",
			ErrConfigMismatch, kv.Bucket(), st.History(), st.LimitMarkerTTL())
	}
	return nil
}

// apiPrefix is the JetStream API prefix js sends its requests to.
func apiPrefix(js jetstream.JetStream) string {
	o := js.Options()
	switch {
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	case o.APIPrefix != "":
		if strings.HasSuffix(o.APIPrefix, ".") {
			return o.APIPrefix
		}
		return o.APIPrefix + "."
	}
	return jetstream.DefaultAPIPrefix
}

// Bucket is the bucket's name.
func (s *Store) Bucket() string { return s.bucket }

// ctx bounds ctx by Options.Timeout unless it has a deadline already.
func (s *Store) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.Timeout)
}

// EnsureConfig stores want if the bucket has no configuration yet and
// returns the stored one. It returns ErrConfigMismatch, naming both values,
// when the stored shard count differs from want's and is not one the type
// had (or a split goes to: TypeConfig.Layout), or when both name a
// strategy and the strategies differ, or when both name an entity kind and
// the kinds differ, or when want names a delivery mode that is not the
// stored one (core when none is stored).
//
// With ErrConfigMismatch the stored configuration is returned too.
func (s *Store) EnsureConfig(ctx context.Context, want protocol.TypeConfig) (protocol.TypeConfig, error) {
	if want.Shards < 1 || want.Shards > protocol.MaxShards {
		return protocol.TypeConfig{}, fmt.Errorf("kvstate: shard count %d out of range 1..%d", want.Shards, protocol.MaxShards)
	}
	data, err := protocol.Encode(want)
	if err != nil {
		return protocol.TypeConfig{}, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	for {
		_, err := s.create(ctx, KeyConfig, data, 0)
		if err == nil {
			return want, nil
		}
		if !isWrongLastSeq(err) {
			return protocol.TypeConfig{}, translate(err, ErrConflict)
		}
		got, err := s.Config(ctx)
		if errors.Is(err, ErrNotFound) {
			continue // deleted in between: try to create it again
		}
		if err != nil {
			return protocol.TypeConfig{}, err
		}
		layout, err := got.Layout()
		if err != nil {
			return got, fmt.Errorf("%w: bucket %s stores a configuration whose shard counts are not a layout: %w", ErrConfigMismatch, s.bucket, err)
		}
		if got.Shards != want.Shards && !layout.Has(want.Shards) {
			return got, fmt.Errorf("%w: bucket %s stores %d shards, this process is configured with %d",
				ErrConfigMismatch, s.bucket, got.Shards, want.Shards)
		}
		if got.Strategy != "" && want.Strategy != "" && got.Strategy != want.Strategy {
			return got, fmt.Errorf("%w: bucket %s stores strategy %q, this process is configured with %q",
				ErrConfigMismatch, s.bucket, got.Strategy, want.Strategy)
		}
		if want.Delivery != "" && got.DeliveryOf() != want.Delivery {
			return got, fmt.Errorf("%w: bucket %s stores delivery %q, this process is configured with %q",
				ErrConfigMismatch, s.bucket, got.DeliveryOf(), want.Delivery)
		}
		if got.Kind != "" && want.Kind != "" && got.Kind != want.Kind {
			return got, fmt.Errorf("%w: bucket %s stores entity kind %q, this process hosts %q",
				ErrConfigMismatch, s.bucket, got.Kind, want.Kind)
		}
		if want.Remember && !got.Remember {
			return got, fmt.Errorf("%w: bucket %s stores a type whose entities are not remembered, this process remembers them",
				ErrConfigMismatch, s.bucket)
		}
		return got, nil
	}
}

// Config reads the stored configuration; ErrNotFound when there is none.
func (s *Store) Config(ctx context.Context) (protocol.TypeConfig, error) {
	var c protocol.TypeConfig
	if _, err := s.loadDecoded(ctx, KeyConfig, &c); err != nil {
		return protocol.TypeConfig{}, err
	}
	return c, nil
}

// subject is the stream subject of key.
func (s *Store) subject(key string) string { return s.subjPrefix + key }

// record is the last message of a key, read from the stream leader.
type record struct {
	value   []byte
	rev     uint64
	deleted bool   // a tombstone: KV delete/purge, or the marker of an expired TTL
	seq     uint64 // an entity state's applied message (protocol.HeaderAppliedSeq)
	answers string // an entity state's kept answers (protocol.HeaderAnswers)
}

// msgGetResponse is the answer of the JetStream API to STREAM.MSG.GET (see
// nats.go jetstream/stream.go, apiMsgGetResponse).
type msgGetResponse struct {
	Error   *jetstream.APIError `json:"error,omitempty"`
	Message *storedMsg          `json:"message,omitempty"`
}

// storedMsg is a message as STREAM.MSG.GET returns it.
type storedMsg struct {
	Subject  string `json:"subject"`
	Sequence uint64 `json:"seq"`
	Header   []byte `json:"hdrs,omitempty"`
	Data     []byte `json:"data,omitempty"`
}

// last reads the last message of key from the stream leader.
//
// A KV bucket's stream always allows direct gets, and kv.Get uses them:
// any replica may answer, and a follower may not have applied the latest
// writes yet. The non-direct API request STREAM.MSG.GET is answered by the
// stream leader only (jsMsgGetRequest in nats-server), which has applied
// every acknowledged write. The error is untranslated; a key without any
// message is the API error 10037.
func (s *Store) last(ctx context.Context, key string) (record, error) {
	req, err := json.Marshal(struct {
		LastBySubject string `json:"last_by_subj"`
	}{s.subject(key)})
	if err != nil {
		return record{}, err
	}
	m, err := msgGet(ctx, s.nc, s.msgGetSubj, req)
	if err != nil {
		return record{}, err
	}
	r := record{value: m.Data, rev: m.Sequence}
	if len(m.Header) > 0 {
		h, err := nats.DecodeHeadersMsg(m.Header)
		if err != nil {
			return record{}, fmt.Errorf("kvstate: bad headers of %s: %w", key, err)
		}
		r.deleted = isTombstone(h)
		if v := h.Get(protocol.HeaderAppliedSeq); v != "" {
			r.seq, _ = strconv.ParseUint(v, 10, 64)
		}
		r.answers = h.Get(protocol.HeaderAnswers)
	}
	return r, nil
}

// leaderKeys reads from the stream leader the keys matching pattern that
// have a message (a value or a tombstone): the subjects of STREAM.INFO.
func (s *Store) leaderKeys(ctx context.Context, pattern string) (map[string]bool, error) {
	info, err := s.stream.Info(ctx, jetstream.WithSubjectFilter(s.subject(pattern)))
	if err != nil {
		return nil, err
	}
	keys := make(map[string]bool, len(info.State.Subjects))
	for subj := range info.State.Subjects {
		keys[strings.TrimPrefix(subj, s.subjPrefix)] = true
	}
	return keys, nil
}

// msgGet asks the JetStream API's STREAM.MSG.GET on subj (answered by
// the stream's leader only, not by a replica that may be behind) with the
// encoded request req. The error is untranslated: an API error as
// returned, 10037 for no such message.
func msgGet(ctx context.Context, nc *nats.Conn, subj string, req []byte) (*storedMsg, error) {
	msg, err := nc.RequestWithContext(ctx, subj, req)
	if err != nil {
		return nil, err
	}
	var resp msgGetResponse
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return nil, fmt.Errorf("kvstate: bad answer to %s: %w", subj, err)
	}
	if resp.Error != nil {
		return nil, resp.Error
	}
	if resp.Message == nil {
		return nil, jetstream.ErrInvalidJetStreamResponse
	}
	return resp.Message, nil
}

// isTombstone says whether a message with headers h marks its key as
// deleted: a KV delete or purge, or a marker the server wrote when a TTL
// ran out (Nats-Marker-Reason).
func isTombstone(h nats.Header) bool {
	switch h.Get(hdrKVOp) {
	case kvOpDel, kvOpPurge:
		return true
	}
	return h.Get(jetstream.MarkerReasonHeader) != ""
}

// load reads key's value and revision from the stream leader, translated:
// ErrNotFound for a missing or deleted key.
func (s *Store) load(ctx context.Context, key string) ([]byte, uint64, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	r, err := s.last(ctx, key)
	if err != nil {
		return nil, 0, translate(fmt.Errorf("read %s: %w", key, err), ErrConflict)
	}
	if r.deleted {
		return nil, 0, fmt.Errorf("%w: %s deleted at revision %d", ErrNotFound, key, r.rev)
	}
	return r.value, r.rev, nil
}

// loadDecoded is load followed by protocol.Decode into v.
func (s *Store) loadDecoded(ctx context.Context, key string, v any) (uint64, error) {
	data, rev, err := s.load(ctx, key)
	if err != nil {
		return 0, err
	}
	if err := protocol.Decode(data, v); err != nil {
		return 0, translate(fmt.Errorf("%s at revision %d: %w", key, rev, err), ErrConflict)
	}
	return rev, nil
}

// lastRev is the revision of key's last message, tombstones included; 0
// when the key has none. It is what an expected-last-subject-sequence check
// compares with.
func (s *Store) lastRev(ctx context.Context, key string) (uint64, error) {
	r, err := s.last(ctx, key)
	if apiCode(err) == codeNoMessage {
		return 0, nil
	}
	return r.rev, err
}

// write publishes data to key with headers hdr and returns the new
// revision. The error is untranslated.
func (s *Store) write(ctx context.Context, key string, data []byte, hdr nats.Header) (uint64, error) {
	m := &nats.Msg{Subject: s.subject(key), Header: nats.Header{}, Data: data}
	for k, v := range hdr {
		m.Header[k] = v
	}
	return s.publish(ctx, m)
}

// publish publishes m to the bucket's stream and returns its sequence.
// The error is untranslated.
func (s *Store) publish(ctx context.Context, m *nats.Msg) (uint64, error) {
	ack, err := s.js.PublishMsg(ctx, m)
	if err != nil {
		s.spaceLog.noteIfNoSpace(err)
		return 0, err
	}
	return ack.Sequence, nil
}

// cas publishes data to key on condition that the last revision of
// checkKey (tombstones included, 0: no message at all) is expect. The
// server checks the condition; a failed check is a wrong-last-sequence API
// error. The error is untranslated.
//
// A replicated stream refuses such a write with 10164 without checking the
// condition while another write to checkKey is in flight. cas then asks the
// stream leader for checkKey's revision: if it is no longer expect the
// refusal stands, otherwise the write is retried with a short backoff until
// ctx ends.
func (s *Store) cas(ctx context.Context, key string, data []byte, hdr nats.Header, checkKey string, expect uint64) (uint64, error) {
	h := nats.Header{}
	for k, v := range hdr {
		h[k] = v
	}
	if checkKey == key {
		h.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect, 10))
	} else {
		s.setFence(h, checkKey, expect)
	}
	return s.whileBusy(ctx, checkKey, expect, func() (uint64, error) { return s.write(ctx, key, data, h) })
}

// setFence makes the message of h conditional on checkKey's last
// revision being expect (0: no message at all).
func (s *Store) setFence(h nats.Header, checkKey string, expect uint64) {
	h.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect, 10))
	h.Set(jetstream.ExpectedLastSubjSeqSubjHeader, s.subject(checkKey))
}

// whileBusy runs write, a write checked against checkKey's revision
// expect, again while a replicated stream refuses it with 10164 (another
// write to checkKey in flight) and checkKey's revision is still expect;
// with a short backoff, until ctx ends. The error is untranslated.
func (s *Store) whileBusy(ctx context.Context, checkKey string, expect uint64, write func() (uint64, error)) (uint64, error) {
	backoff := 2 * time.Millisecond
	for {
		rev, err := write()
		if err == nil || !isSubjectBusy(err) {
			return rev, err
		}
		cur, rerr := s.lastRev(ctx, checkKey)
		if rerr != nil {
			return 0, rerr
		}
		if cur != expect {
			return 0, err
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, fmt.Errorf("kvstate: %s kept busy by writes in flight (%v): %w", checkKey, err, ctx.Err())
		case <-t.C:
		}
		backoff = min(2*backoff, 50*time.Millisecond)
	}
}

// create writes data to key if the key does not exist or is deleted, with a
// TTL of ttl seconds unless ttl is 0. It fails with a wrong-last-sequence
// error when the key exists. The error is untranslated.
//
// kv.Create does the same, but learns the revision of a tombstone with a
// direct get, which a stale follower may answer; create asks the stream
// leader.
func (s *Store) create(ctx context.Context, key string, data []byte, ttl int64) (uint64, error) {
	return s.createWith(ctx, key, data, ttl, nil)
}

// createWith is create, with the headers hdr on the written message too.
func (s *Store) createWith(ctx context.Context, key string, data []byte, ttl int64, extra nats.Header) (uint64, error) {
	hdr := nats.Header{}
	for k, v := range extra {
		hdr[k] = v
	}
	if ttl > 0 {
		hdr.Set(jetstream.MsgTTLHeader, ttlHeader(ttl))
	}
	var expect uint64
	for attempt := 0; ; attempt++ {
		rev, err := s.cas(ctx, key, data, hdr, key, expect)
		if err == nil || !isWrongLastSeq(err) || attempt == 3 {
			return rev, err
		}
		r, rerr := s.last(ctx, key)
		switch {
		case apiCode(rerr) == codeNoMessage:
			expect = 0 // the tombstone expired in between
		case rerr != nil:
			return 0, rerr
		case !r.deleted:
			return 0, err // the key exists
		default:
			expect = r.rev
		}
	}
}

// tombstone writes a delete marker for key on condition that its last
// revision is rev. With purge, the marker is a KV purge that expires after
// markerTTL, leaving nothing behind; otherwise it is a KV delete that stays
// until the key is written again. The error is untranslated.
func (s *Store) tombstone(ctx context.Context, key string, rev uint64, purge bool, checkKey string) error {
	hdr := nats.Header{}
	if purge {
		hdr.Set(hdrKVOp, kvOpPurge)
		hdr.Set(hdrRollup, rollupSubject)
		hdr.Set(jetstream.MsgTTLHeader, ttlHeader(int64(markerTTL/time.Second)))
	} else {
		hdr.Set(hdrKVOp, kvOpDel)
	}
	_, err := s.cas(ctx, key, nil, hdr, checkKey, rev)
	return err
}

// ttlSeconds converts a lease TTL into the whole seconds JetStream keeps
// per-message TTLs in, rounding up. The server's minimum is one second.
func ttlSeconds(ttl time.Duration) (int64, error) {
	if ttl < time.Second {
		return 0, fmt.Errorf("kvstate: lease TTL %v is below the minimum of 1s (JetStream TTLs are whole seconds)", ttl)
	}
	return int64((ttl + time.Second - 1) / time.Second), nil
}

// ttlHeader is the Nats-TTL header value for secs seconds.
func ttlHeader(secs int64) string { return strconv.FormatInt(secs, 10) + "s" }
