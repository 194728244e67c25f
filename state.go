package natshard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// StateStore persists the state of a type's entities: bytes per entity id
// with a revision, written with compare-and-set. Env.Store is the type's
// (its KV bucket); State is the typed way to use it. Errors wrap
// ErrNotFound when an entity has no state and ErrConflict when a revision
// is not the current one.
type StateStore interface {
	// LoadEntity returns the state of id and its revision.
	LoadEntity(ctx context.Context, id string) ([]byte, uint64, error)
	// SaveEntity writes the state of id if its revision is still rev (0:
	// id has no state yet) and returns the new revision.
	SaveEntity(ctx context.Context, id string, data []byte, rev uint64) (uint64, error)
	// DeleteEntity deletes the state of id if its revision is still rev.
	DeleteEntity(ctx context.Context, id string, rev uint64) error
}

// SeqStore is a StateStore that saves, with each state and in the same
// compare-and-set, the stream sequence of the message that made it
// (durable delivery), so that a message given again after a crash is
// applied once: State uses it when its store is one. *kvstate.Store is.
type SeqStore interface {
	LoadEntitySeq(ctx context.Context, id string) (data []byte, rev, seq uint64, err error)
	SaveEntitySeq(ctx context.Context, id string, data []byte, rev, seq uint64) (uint64, error)
}

// EntityState is an entity's state as an AnswerStore stores it: the
// bytes, the revision, the applied stream sequence and the answers to the
// last keyed messages the state applied (region.Answers' encoding).
type EntityState = kvstate.EntityState

// AnswerStore is a SeqStore that also saves, with each state and in the
// same compare-and-set, the answers to the last keyed messages the state
// applied, so that a message sent again with its key after a move or a
// crash is answered as the first time and not applied again (the kv
// kind does: docs/PROTOCOL.md, "Idempotency keys"). *kvstate.Store is.
type AnswerStore interface {
	LoadEntityState(ctx context.Context, id string) (EntityState, error)
	SaveEntityState(ctx context.Context, id string, s EntityState) (uint64, error)
}

var (
	_ StateStore  = (*kvstate.Store)(nil)
	_ SeqStore    = (*kvstate.Store)(nil)
	_ AnswerStore = (*kvstate.Store)(nil)
)

// State is an entity's persisted state: a T kept in memory and in the
// type's KV bucket, as JSON, with the revision it was stored at. Update
// changes both at once with compare-and-set, so a change is saved before
// the entity answers, and a write of a previous owner of the shard (a
// forced reallocation) is never overwritten blindly.
//
// In durable delivery, Update also saves the stream sequence of the
// message being handled (SeqFrom of its context), and does nothing for a
// message at or below the one the state applied last: a message given
// again after a crash is applied once, with or without a Nats-Msg-Id.
//
// UpdateAnswer is Update for a handler whose answer comes with the
// change: the answer is saved with the state, in the same compare-and-set,
// under the message's idempotency key (MsgID), and a message sent again
// with that key, after a move or a crash too, gets it back without being
// applied again (docs/PROTOCOL.md, "Idempotency keys").
//
// A State belongs to one entity, which uses it from Handle, one message at
// a time: it has no lock.
type State[T any] struct {
	store StateStore
	id    string
	val   T
	data  []byte // val as stored; nil when nothing is
	rev   uint64 // 0 when nothing is stored
	seq   uint64 // the stream sequence of the message the state applied last
	// answers are the answers to the last keyed changes, saved with the
	// state when the store is an AnswerStore (region.SavedAnswers).
	answers region.Answers
}

// LoadState loads the persisted state of the entity being activated, in
// its Factory (ctx carries its Env); a zero T when it has none. The
// entity's region then asks the state for the answers it saved
// (UpdateAnswer) before it gives the entity a message with an idempotency
// key.
func LoadState[T any](ctx context.Context) (*State[T], error) {
	env := EnvFrom(ctx)
	if env == nil {
		return nil, errors.New("natshard: LoadState needs the context a Factory is given")
	}
	s, err := OpenState[T](ctx, env.Store, env.ID)
	if err != nil {
		return nil, err
	}
	env.answers = append(env.answers, s.Answer)
	return s, nil
}

// OpenState loads the state of entity id from store; a zero T when it has
// none. LoadState is OpenState with the entity's Env. (An entity that
// opens its state so, and saves answers with UpdateAnswer, is a
// region.AnswerKeeper with State.Answer for them to be found after a move
// or a crash.)
func OpenState[T any](ctx context.Context, store StateStore, id string) (*State[T], error) {
	s := &State[T]{store: store, id: id, answers: region.Answers{MaxKeys: region.SavedAnswers, MaxBytes: region.SavedAnswerBytes}}
	if err := s.load(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// Answer returns the answer UpdateAnswer saved for the message with key
// (region.AnswerKeeper's method).
func (s *State[T]) Answer(key string) (region.KeptAnswer, bool) { return s.answers.Get(key) }

// Value is the state. Change it with Update only: a change made to it
// otherwise is neither saved nor kept.
func (s *State[T]) Value() T { return s.val }

// Revision is the revision the state was stored at; 0 when it has none.
func (s *State[T]) Revision() uint64 { return s.rev }

// Applied reports whether the message being handled (its context: ctx)
// was applied to the state already, in durable delivery: its stream
// sequence is at or below the last one the state saved. Update does
// nothing for such a message; an entity that answers may check Applied
// first.
func (s *State[T]) Applied(ctx context.Context) bool {
	seq := region.SeqFrom(ctx)
	return seq != 0 && seq <= s.seq
}

// Update calls change with the state, saves the result (compare-and-set
// on the revision held) and keeps it. change gets no copy: a pointer to
// the value State holds, which it changes in place (a T that Value
// returned earlier shares its maps and slices, and may see the change);
// it must not keep the pointer after it returns.
// When change or the save fails, the state is what it was before (State
// decodes its last saved bytes again, into a new value) and the error is
// returned. When another writer saved the state since it was loaded,
// Update loads theirs and calls change once more: change must compute the
// new state from the one it is given, without effects elsewhere. For a
// message the state applied already (Applied), Update does nothing and
// returns nil.
func (s *State[T]) Update(ctx context.Context, change func(*T) error) error {
	_, err := s.update(ctx, "", func(v *T) ([]byte, error) { return nil, change(v) })
	return err
}

// UpdateAnswer is Update for a message m whose answer change returns with
// the change: with an idempotency key (m.IdempotencyKey(), MsgID), the
// answer is saved with the state in the same compare-and-set, and m sent
// again with that key is answered with it, without calling change,
// whichever region holds the entity then (its region asks Answer first:
// the entity's Handle is not even called). An error of change is
// returned, nothing saved. For a message the state applied already
// (Applied: durable delivery, after a crash) whose answer it does not
// keep, it returns an error wrapping ErrNoAnswer. The window is
// region.SavedAnswers keys.
func (s *State[T]) UpdateAnswer(ctx context.Context, m *Message, change func(*T) ([]byte, error)) ([]byte, error) {
	return s.update(ctx, m.IdempotencyKey(), change)
}

func (s *State[T]) update(ctx context.Context, key string, change func(*T) ([]byte, error)) ([]byte, error) {
	seq := region.SeqFrom(ctx)
	for attempt := 0; ; attempt++ {
		if key != "" {
			if ans, ok := s.answers.Get(key); ok {
				return keptAnswer(ans)
			}
		}
		if s.Applied(ctx) {
			if key != "" {
				return nil, fmt.Errorf("natshard: state of %q: %w: message %d applied already", s.id, ErrNoAnswer, seq)
			}
			return nil, nil
		}
		out, err := change(&s.val)
		if err != nil {
			s.restore()
			return out, err
		}
		data, err := json.Marshal(s.val)
		if err != nil {
			s.restore()
			return nil, fmt.Errorf("natshard: encode the state of %q: %w", s.id, err)
		}
		answers := s.answers
		if key != "" {
			answers = s.answers.Clone()
			answers.Add(region.SavedAnswer(key, out, ""))
		}
		rev, err := s.save(ctx, data, seq, answers.Encode())
		if err == nil {
			s.data, s.rev, s.answers = data, rev, answers
			if seq != 0 {
				s.seq = seq
			}
			return out, nil
		}
		s.restore()
		if !errors.Is(err, ErrConflict) || attempt > 0 {
			return nil, fmt.Errorf("natshard: save the state of %q: %w", s.id, err)
		}
		if lerr := s.load(ctx); lerr != nil {
			return nil, fmt.Errorf("natshard: save the state of %q: %w; reload: %w", s.id, err, lerr)
		}
	}
}

// keptAnswer is what UpdateAnswer returns for a kept answer.
func keptAnswer(ans region.KeptAnswer) ([]byte, error) {
	if ans.Error != "" && ans.Code != "" {
		return ans.Data, &protocol.CodedError{Code: ans.Code, Text: ans.Error}
	}
	if ans.Error != "" {
		return ans.Data, errors.New(ans.Error)
	}
	return ans.Data, nil
}

// Delete removes the persisted state (compare-and-set on the revision
// held); the state is a zero T afterwards.
func (s *State[T]) Delete(ctx context.Context) error {
	if s.rev == 0 {
		var zero T
		s.val = zero
		return nil
	}
	if err := s.store.DeleteEntity(ctx, s.id, s.rev); err != nil {
		return fmt.Errorf("natshard: delete the state of %q: %w", s.id, err)
	}
	var zero T
	s.val, s.data, s.rev, s.seq = zero, nil, 0, 0
	_ = s.answers.Decode("")
	return nil
}

// save writes data at the revision held, with the applied sequence seq
// and the answers when the store keeps them.
func (s *State[T]) save(ctx context.Context, data []byte, seq uint64, answers string) (uint64, error) {
	if as, ok := s.store.(AnswerStore); ok {
		return as.SaveEntityState(ctx, s.id, EntityState{Data: data, Rev: s.rev, Seq: max(seq, s.seq), Answers: answers})
	}
	if ss, ok := s.store.(SeqStore); ok {
		return ss.SaveEntitySeq(ctx, s.id, data, s.rev, max(seq, s.seq))
	}
	return s.store.SaveEntity(ctx, s.id, data, s.rev)
}

// load reads the stored state.
func (s *State[T]) load(ctx context.Context) error {
	var (
		data     []byte
		rev, seq uint64
		answers  string
		err      error
	)
	if as, ok := s.store.(AnswerStore); ok {
		var st EntityState
		st, err = as.LoadEntityState(ctx, s.id)
		data, rev, seq, answers = st.Data, st.Rev, st.Seq, st.Answers
	} else if ss, ok := s.store.(SeqStore); ok {
		data, rev, seq, err = ss.LoadEntitySeq(ctx, s.id)
	} else {
		data, rev, err = s.store.LoadEntity(ctx, s.id)
	}
	if errors.Is(err, ErrNotFound) {
		data, rev, seq, answers = nil, 0, 0, ""
	} else if err != nil {
		return fmt.Errorf("natshard: load the state of %q: %w", s.id, err)
	}
	val, err := decodeState[T](data)
	if err != nil {
		return fmt.Errorf("natshard: load the state of %q at revision %d: %w", s.id, rev, err)
	}
	if err := s.answers.Decode(answers); err != nil {
		return fmt.Errorf("natshard: load the state of %q at revision %d: %w", s.id, rev, err)
	}
	s.val, s.data, s.rev, s.seq = val, data, rev, seq
	return nil
}

// restore puts back the state as stored, after change altered it.
func (s *State[T]) restore() {
	// It decoded before, so it decodes again.
	s.val, _ = decodeState[T](s.data)
}

func decodeState[T any](data []byte) (T, error) {
	var v T
	if data == nil {
		return v, nil
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return v, fmt.Errorf("%w: %v", kvstate.ErrMalformed, err)
	}
	return v, nil
}
