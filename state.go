package natshard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/region"
)

// Errors of persisted state, returned wrapped; test with errors.Is.
var (
	// ErrNotFound: an entity has no persisted state.
	ErrNotFound = kvstate.ErrNotFound
	// ErrConflict: a compare-and-set failed: the state's revision is not
	// the one the writer held (another writer came first).
	ErrConflict = kvstate.ErrConflict
	// ErrUnavailable: NATS or JetStream did not answer (a timeout, a
	// leader election). In durable delivery, a message whose entity (or
	// Factory) returns an error wrapping it is given to the entity again,
	// before its later messages, instead of being answered with the error
	// and consumed: State's errors wrap it when they should.
	ErrUnavailable = kvstate.ErrUnavailable
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
// A State belongs to one entity, which uses it from Handle, one message at
// a time: it has no lock.
type State[T any] struct {
	store StateStore
	id    string
	val   T
	data  []byte // val as stored; nil when nothing is
	rev   uint64 // 0 when nothing is stored
	seq   uint64 // the stream sequence of the message the state applied last
}

// LoadState loads the persisted state of the entity being activated, in
// its Factory (ctx carries its Env); a zero T when it has none.
func LoadState[T any](ctx context.Context) (*State[T], error) {
	env := EnvFrom(ctx)
	if env == nil {
		return nil, errors.New("natshard: LoadState needs the context a Factory is given")
	}
	return OpenState[T](ctx, env.Store, env.ID)
}

// OpenState loads the state of entity id from store; a zero T when it has
// none. LoadState is OpenState with the entity's Env.
func OpenState[T any](ctx context.Context, store StateStore, id string) (*State[T], error) {
	s := &State[T]{store: store, id: id}
	if err := s.load(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

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
// on the revision held) and keeps it. When change or the save fails, the
// state is what it was before and the error is returned. When another
// writer saved the state since it was loaded, Update loads theirs and
// calls change once more: change must compute the new state from the one
// it is given, without effects elsewhere. For a message the state applied
// already (Applied), Update does nothing and returns nil.
func (s *State[T]) Update(ctx context.Context, change func(*T) error) error {
	seq := region.SeqFrom(ctx)
	for attempt := 0; ; attempt++ {
		if s.Applied(ctx) {
			return nil
		}
		if err := change(&s.val); err != nil {
			s.restore()
			return err
		}
		data, err := json.Marshal(s.val)
		if err != nil {
			s.restore()
			return fmt.Errorf("natshard: encode the state of %q: %w", s.id, err)
		}
		rev, err := s.save(ctx, data, seq)
		if err == nil {
			s.data, s.rev = data, rev
			if seq != 0 {
				s.seq = seq
			}
			return nil
		}
		s.restore()
		if !errors.Is(err, ErrConflict) || attempt > 0 {
			return fmt.Errorf("natshard: save the state of %q: %w", s.id, err)
		}
		if lerr := s.load(ctx); lerr != nil {
			return fmt.Errorf("natshard: save the state of %q: %w; reload: %w", s.id, err, lerr)
		}
	}
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
	return nil
}

// save writes data at the revision held, with the applied sequence seq
// when the store keeps it.
func (s *State[T]) save(ctx context.Context, data []byte, seq uint64) (uint64, error) {
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
		err      error
	)
	if ss, ok := s.store.(SeqStore); ok {
		data, rev, seq, err = ss.LoadEntitySeq(ctx, s.id)
	} else {
		data, rev, err = s.store.LoadEntity(ctx, s.id)
	}
	if errors.Is(err, ErrNotFound) {
		data, rev, seq = nil, 0, 0
	} else if err != nil {
		return fmt.Errorf("natshard: load the state of %q: %w", s.id, err)
	}
	val, err := decodeState[T](data)
	if err != nil {
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
