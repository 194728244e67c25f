package entities

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/big"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/region"
)

// MaxDocumentSize bounds the JSON encoding of a kv entity's document: 1
// MiB (NATS's default max_payload) less 4 KiB, so that the KV write with
// its headers and the whole-document answer fit a NATS message. On a
// server with a smaller max_payload, a change that makes the document too
// large for it fails with "maximum payload exceeded" and is not applied.
const MaxDocumentSize = 1<<20 - 4<<10

// Errors of kv entities, returned (wrapped) by Handle with the
// {"ok":false,...} answer; test for them with errors.Is. Store failures are
// returned wrapped as they come from the StateStore.
var (
	// ErrBadRequest: malformed JSON, unknown op, missing key or value, or
	// a value of the wrong type for the operation.
	ErrBadRequest = errors.New("bad request")
	// ErrDocumentTooLarge: the change would make the document larger than
	// MaxDocumentSize.
	ErrDocumentTooLarge = errors.New("document too large")
)

// KV returns the factory of kv entities: persistent JSON documents stored in
// store under the entity id (see the package documentation). The factory
// loads the document; a missing state is an empty document. With a nil
// store, each entity's is its type's own (its natshard.Env's Store), as in
// shardd.
func KV(store StateStore) region.Factory {
	return func(ctx context.Context, id string) (region.Entity, error) {
		store := store
		if store == nil {
			env := natshard.EnvFrom(ctx)
			if env == nil {
				return nil, errors.New("entities: a kv entity with no store outside a natshard node")
			}
			store = env.Store
		}
		e := &kvEntity{store: store, id: id, retryFor: SaveRetryFor, answers: region.Answers{MaxKeys: KeptAnswers, MaxBytes: KeptAnswerBytes}}
		if err := e.loadAgain(ctx); err != nil {
			return nil, err
		}
		return e, nil
	}
}

var (
	_ region.AnswerKeeper = (*kvEntity)(nil)
	_ region.Flusher      = (*kvEntity)(nil)
)

// kvEntity is one document. The region calls it from one goroutine at a
// time, so it needs no lock.
type kvEntity struct {
	store StateStore
	id    string
	doc   map[string]any // never nil; values as decoded with UseNumber
	rev   uint64         // revision of doc in the store; 0: not stored yet
	seq   uint64         // stream sequence of the message doc applied last (durable delivery)
	// answers are the answers to the last keyed messages that changed
	// doc, saved with it when the store is a natshard.AnswerStore.
	answers region.Answers
	// retryFor bounds saveAgain and loadAgain (SaveRetryFor).
	retryFor time.Duration
	// unsaved is the encoding of doc when messages of durable delivery
	// changed it since it was stored (doc, seq and answers are then
	// theirs): Flush stores it. nil when doc is stored.
	unsaved []byte
}

// The window of answers a kv entity saves with its document (with a
// store that keeps them: natshard.AnswerStore, as its type's bucket is):
// the keys of the last KeptAnswers messages with an idempotency key that
// changed the document, and their answers while they fit in
// KeptAnswerBytes with the keys. A message sent again with one of those
// keys, after a move or a crash, is answered as the first time (or, its
// answer dropped for space, with an error saying it was applied) and not
// applied again. An answer larger than KeptAnswerBytes is kept as an
// error saying that the message was applied and its answer not kept. (While the entity is
// active, its region keeps the answers to the last 64 keyed messages,
// reads included, whatever their size.)
const (
	KeptAnswers     = region.SavedAnswers
	KeptAnswerBytes = region.SavedAnswerBytes
)

// SaveRetryFor bounds how long a kv entity tries again what JetStream did
// not answer (kvstate.ErrUnavailable but not ErrNoSpace): the bucket
// electing a leader after a NATS server's loss takes a few seconds (4 to
// 12 s measured). A save is tried again in core delivery, where the message
// exists nowhere else and failing at once would lose it (in durable
// delivery the region gives the message again instead:
// region.ErrUnavailable). A load of the state (at activation, or to reload
// it after a conflict) is tried again in either delivery: the chaos test's
// NATS server kill refused 16 requests whose entity could not load its
// state during the election.
const SaveRetryFor = 30 * time.Second

// load reads the document, and in durable delivery (a store that keeps
// it) the sequence of the message it applied last.
func (e *kvEntity) load(ctx context.Context) error {
	var (
		data     []byte
		rev, seq uint64
		answers  string
		err      error
	)
	if as, ok := e.store.(natshard.AnswerStore); ok {
		var st natshard.EntityState
		st, err = as.LoadEntityState(ctx, e.id)
		data, rev, seq, answers = st.Data, st.Rev, st.Seq, st.Answers
	} else if ss, ok := e.store.(natshard.SeqStore); ok {
		data, rev, seq, err = ss.LoadEntitySeq(ctx, e.id)
	} else {
		data, rev, err = e.store.LoadEntity(ctx, e.id)
	}
	if errors.Is(err, kvstate.ErrNotFound) {
		e.doc, e.rev, e.seq = map[string]any{}, 0, 0
		_ = e.answers.Decode("")
		return nil
	}
	if err != nil {
		return fmt.Errorf("load state of %q: %w", e.id, err)
	}
	var doc map[string]any
	if err := decodeStrict(data, &doc); err != nil || doc == nil {
		if err == nil {
			err = errors.New("not a JSON object")
		}
		return fmt.Errorf("load state of %q: %w: %v", e.id, kvstate.ErrMalformed, err)
	}
	if err := e.answers.Decode(answers); err != nil {
		return fmt.Errorf("load state of %q: %w", e.id, err)
	}
	e.doc, e.rev, e.seq = doc, rev, seq
	return nil
}

// loadAgain is load, tried again while JetStream does not answer, for up
// to e.retryFor or until ctx ends (the shard leaves the region). A read
// changes nothing, so trying it again needs no care.
func (e *kvEntity) loadAgain(ctx context.Context) error {
	deadline := time.Now().Add(e.retryFor)
	err := e.load(ctx)
	for backoff := wait.RetryFirst; unanswered(err) && time.Now().Before(deadline); backoff = wait.Next(backoff) {
		if !wait.Sleep(ctx, min(backoff, time.Until(deadline))) {
			return err
		}
		err = e.load(ctx)
	}
	return err
}

// save writes next at the revision held, with the applied sequence seq
// and the answers when the store keeps them.
func (e *kvEntity) save(ctx context.Context, next []byte, seq uint64, answers string) (uint64, error) {
	if as, ok := e.store.(natshard.AnswerStore); ok {
		return as.SaveEntityState(ctx, e.id, natshard.EntityState{Data: next, Rev: e.rev, Seq: max(seq, e.seq), Answers: answers})
	}
	if ss, ok := e.store.(natshard.SeqStore); ok {
		return ss.SaveEntitySeq(ctx, e.id, next, e.rev, max(seq, e.seq))
	}
	return e.store.SaveEntity(ctx, e.id, next, e.rev)
}

// saveAgain tries again, for up to e.retryFor, a save of data that failed
// with err (kvstate.ErrUnavailable), without applying the message twice:
// a save whose answer was lost may have been stored, or may still be in
// flight and be stored later, so before each new attempt, and after one
// refused for a conflict, it reads the state back. Data at a newer
// revision is the lost answer's write (the entity is its state's only
// writer); other state at a newer revision is someone else's:
// ErrConflict, for Handle to reload and apply once more.
func (e *kvEntity) saveAgain(ctx context.Context, data []byte, answers string, err error) (uint64, error) {
	deadline := time.Now().Add(e.retryFor)
	for backoff := wait.RetryFirst; unanswered(err) && time.Now().Before(deadline); backoff = wait.Next(backoff) {
		if !wait.Sleep(ctx, min(backoff, time.Until(deadline))) {
			return 0, err
		}
		stored, rev, lerr := e.store.LoadEntity(ctx, e.id)
		switch {
		case errors.Is(lerr, kvstate.ErrNotFound) && e.rev == 0, lerr == nil && rev == e.rev:
			// Not stored (yet): save again. The first save, if still in
			// flight, may land before this one is checked.
		case lerr != nil && !errors.Is(lerr, kvstate.ErrNotFound):
			err = lerr
			continue
		case lerr == nil && bytes.Equal(stored, data):
			return rev, nil // stored: the answer was lost
		default:
			return 0, fmt.Errorf("%w: the state of %q changed while its save was unanswered (%w)", kvstate.ErrConflict, e.id, err)
		}
		if rev, err = e.save(ctx, data, 0, answers); err == nil {
			return rev, nil
		}
		if !errors.Is(err, kvstate.ErrConflict) {
			continue
		}
		// The first save landed meanwhile, or someone else wrote: the
		// state read back tells which. Unreadable, the loop reads again.
		stored, rev, lerr = e.store.LoadEntity(ctx, e.id)
		switch {
		case lerr == nil && bytes.Equal(stored, data):
			return rev, nil // the first save, stored late
		case lerr == nil || errors.Is(lerr, kvstate.ErrNotFound):
			return 0, err
		}
		err = lerr
	}
	return 0, err
}

// unanswered: JetStream did not answer (kvstate.ErrUnavailable), which
// passes with a leader election. A refusal for lack of space
// (kvstate.ErrNoSpace, also ErrUnavailable) is answered at once: it
// passes only when an operator frees space, and its error says so.
func unanswered(err error) bool {
	return errors.Is(err, kvstate.ErrUnavailable) && !errors.Is(err, kvstate.ErrNoSpace)
}

// decodeStrict decodes exactly one JSON value from data, keeping numbers as
// json.Number.
func decodeStrict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return errors.New("empty input")
		}
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("data after the JSON value")
	}
	return nil
}

// kvRequest is a decoded request.
type kvRequest struct {
	op    string
	key   string
	hasK  bool
	value any
	hasV  bool
	by    *big.Int // incr only
}

func parseRequest(data []byte) (kvRequest, error) {
	var raw struct {
		Op    *string         `json:"op"`
		Key   *string         `json:"key"`
		Value json.RawMessage `json:"value"`
		By    json.RawMessage `json:"by"`
	}
	// json.Unmarshal takes one JSON value, as decodeStrict, without a
	// Decoder to allocate: a fifth of a kv message's CPU was spent
	// here. What it refuses, decodeStrict refuses too, with its error.
	if json.Unmarshal(data, &raw) != nil {
		if err := decodeStrict(data, &raw); err != nil {
			return kvRequest{}, badRequest("malformed request: %v", err)
		}
	}
	if raw.Op == nil {
		return kvRequest{}, badRequest("missing op")
	}
	r := kvRequest{op: *raw.Op}
	if raw.Key != nil {
		r.key, r.hasK = *raw.Key, true
	}
	if raw.Value != nil {
		var str string
		if len(raw.Value) > 0 && raw.Value[0] == '"' && json.Unmarshal(raw.Value, &str) == nil {
			r.value = str // a string needs no json.Number
		} else if err := decodeStrict(raw.Value, &r.value); err != nil {
			return kvRequest{}, badRequest("malformed value: %v", err)
		}
		r.hasV = true
	}
	switch r.op {
	case "get":
		return r, nil
	case "set", "append":
		if !r.hasV {
			return kvRequest{}, badRequest("%s needs a value", r.op)
		}
	case "incr":
		r.by = big.NewInt(1)
		if raw.By != nil {
			var by any
			if err := decodeStrict(raw.By, &by); err != nil {
				return kvRequest{}, badRequest("malformed by: %v", err)
			}
			n, ok := integer(by)
			if !ok {
				return kvRequest{}, badRequest("by must be an integer, not %s", describe(by))
			}
			r.by = n
		}
	case "delete":
	case "":
		return kvRequest{}, badRequest("missing op")
	default:
		return kvRequest{}, badRequest("unknown op %q (want get, set, incr, append or delete)", r.op)
	}
	if !r.hasK {
		return kvRequest{}, badRequest("%s needs a key", r.op)
	}
	return r, nil
}

func badRequest(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadRequest, fmt.Sprintf(format, args...))
}

// integer returns v as an integer when it is a JSON integer literal.
func integer(v any) (*big.Int, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return nil, false
	}
	return new(big.Int).SetString(string(n), 10)
}

// describe names the JSON type of v for error messages.
func describe(v any) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case json.Number:
		if _, ok := integer(v); ok {
			return "an integer"
		}
		return "a number"
	case string:
		return "a string"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}

// apply computes the effect of r on doc without changing doc. It returns
// the new document (nil when unchanged) and the value to answer.
func apply(doc map[string]any, r kvRequest) (next map[string]any, value any, err error) {
	if r.op == "get" {
		if !r.hasK {
			return nil, doc, nil
		}
		return nil, doc[r.key], nil
	}
	cur, exists := doc[r.key]
	switch r.op {
	case "set":
		value = r.value
	case "incr":
		n := new(big.Int)
		if exists {
			var ok bool
			if n, ok = integer(cur); !ok {
				return nil, nil, badRequest("incr: the value at %q is %s, not an integer", r.key, describe(cur))
			}
		}
		value = json.Number(n.Add(n, r.by).String())
	case "append":
		switch c := cur.(type) {
		case nil:
			if exists {
				return nil, nil, badRequest("append: the value at %q is null, not an array or a string", r.key)
			}
			value = []any{r.value}
		case []any:
			value = append(c[:len(c):len(c)], r.value) // copies: doc keeps its array
		case string:
			s, ok := r.value.(string)
			if !ok {
				return nil, nil, badRequest("append: cannot append %s to the string at %q", describe(r.value), r.key)
			}
			value = c + s
		default:
			return nil, nil, badRequest("append: the value at %q is %s, not an array or a string", r.key, describe(cur))
		}
	case "delete":
		if !exists {
			return nil, nil, nil
		}
		next = maps.Clone(doc)
		delete(next, r.key)
		return next, nil, nil
	}
	next = maps.Clone(doc)
	next[r.key] = value
	return next, value, nil
}

// encodeJSON encodes v without HTML escaping and without trailing newline.
func encodeJSON(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// Handle applies one request (see the package documentation).
func (e *kvEntity) Handle(ctx context.Context, m *region.Message) ([]byte, error) {
	r, err := parseRequest(m.Data)
	if err != nil {
		return failure(err)
	}
	seq := region.SeqFrom(ctx)
	key := m.IdempotencyKey()
	for attempt := 0; ; attempt++ {
		if key != "" {
			if ans, ok := e.Answer(key); ok {
				// Applied already, by the writer whose state a conflict
				// made this entity read (its region asked Answer before
				// Handle).
				return answerOf(ans)
			}
		}
		if seq != 0 && seq <= e.seq && r.op != "get" {
			// Given again after a crash: applied already. The answer
			// is the value now (later messages may have changed it).
			_, value, _ := apply(e.doc, kvRequest{op: "get", key: r.key, hasK: true})
			return success(value)
		}
		next, value, err := apply(e.doc, r)
		if err != nil {
			return failure(err)
		}
		if next == nil {
			return success(value)
		}
		data, err := encodeJSON(next)
		if err != nil {
			return failure(fmt.Errorf("encode document: %w", err))
		}
		if len(data) > MaxDocumentSize {
			return failure(fmt.Errorf("%w: %d bytes after %s, at most %d", ErrDocumentTooLarge, len(data), r.op, MaxDocumentSize))
		}
		out, err := success(value)
		if err != nil {
			return out, err
		}
		if seq != 0 && region.WillFlush(ctx) {
			// Durable delivery: applied in memory, stored by Flush
			// with the run's other messages before any is answered or
			// acknowledged (region.Flusher).
			if key != "" {
				e.answers.Add(region.SavedAnswer(key, out, ""))
			}
			e.doc, e.seq, e.unsaved = next, seq, data
			return out, nil
		}
		answers := e.answers
		if key != "" {
			answers = e.answers.Clone()
			answers.Add(region.SavedAnswer(key, out, ""))
		}
		enc := answers.Encode()
		rev, err := e.save(ctx, data, seq, enc)
		if unanswered(err) && seq == 0 {
			rev, err = e.saveAgain(ctx, data, enc, err)
		}
		if err == nil {
			e.doc, e.rev, e.answers = next, rev, answers
			if seq != 0 {
				e.seq = seq
			}
			return out, nil
		}
		if !errors.Is(err, kvstate.ErrConflict) || attempt > 0 {
			return failure(fmt.Errorf("save state: %w", err))
		}
		// Someone else wrote the state: take theirs and apply once more
		// (unless theirs applied this message already).
		if lerr := e.loadAgain(ctx); lerr != nil {
			return failure(fmt.Errorf("save state: %w; reload: %w", err, lerr))
		}
		if stored, err := encodeJSON(e.doc); err == nil && bytes.Equal(stored, data) {
			// The state read back is exactly what this save wrote: the
			// save was stored though answered with a conflict (the
			// chaos test saw it while the bucket's leader changed), or
			// another writer left the very state this message would:
			// applying it once more would apply it twice.
			return success(value)
		}
	}
}

// Flush stores the document that messages of durable delivery changed
// since it was stored, with the sequence of the last one and the
// answers (region.Flusher): one write for a run of messages. A failed
// Flush leaves the document in memory unstored; the region then drops
// this entity and a new one loads the stored state.
func (e *kvEntity) Flush(ctx context.Context) error {
	if e.unsaved == nil {
		return nil
	}
	rev, err := e.save(ctx, e.unsaved, e.seq, e.answers.Encode())
	if err != nil {
		return fmt.Errorf("save state of %q: %w", e.id, err)
	}
	e.rev, e.unsaved = rev, nil
	return nil
}

// Answer returns the answer the entity saved with its document for the
// message with key (region.AnswerKeeper).
func (e *kvEntity) Answer(key string) (region.KeptAnswer, bool) { return e.answers.Get(key) }

// answerOf is Handle's return for a kept answer.
func answerOf(ans region.KeptAnswer) ([]byte, error) { return ans.Data, ans.Err() }

// Stop does nothing: every change was saved when it was made, or by the
// Flush that the region calls before it answers a message of durable
// delivery.
func (e *kvEntity) Stop(context.Context) error { return nil }

// kvFailure is the answer to a request that failed.
type kvFailure struct {
	OK    bool   `json:"ok"` // always false
	Error string `json:"error"`
}

func success(value any) ([]byte, error) {
	// value is always written, null included: encode by hand around it.
	v, err := encodeJSON(value)
	if err != nil {
		return failure(fmt.Errorf("encode value: %w", err))
	}
	out := make([]byte, 0, len(v)+20)
	out = append(out, `{"ok":true,"value":`...)
	out = append(out, v...)
	return append(out, '}'), nil
}

func failure(err error) ([]byte, error) {
	body, _ := encodeJSON(kvFailure{Error: err.Error()})
	return body, err
}
