package kvstate

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/natshard/natshard/protocol"
)

// LoadEntity reads an entity's persisted state from the stream leader.
// ErrNotFound when it has none.
func (s *Store) LoadEntity(ctx context.Context, id string) ([]byte, uint64, error) {
	data, rev, _, err := s.LoadEntitySeq(ctx, id)
	return data, rev, err
}

// SaveEntity writes an entity's state if its revision is still rev (0: the
// entity has no state yet). ErrConflict otherwise. Returns the new revision.
//
// With rev 0 the write succeeds when the entity never had state and when
// its state was deleted.
func (s *Store) SaveEntity(ctx context.Context, id string, data []byte, rev uint64) (uint64, error) {
	return s.SaveEntitySeq(ctx, id, data, rev, 0)
}

// LoadEntitySeq is LoadEntity, with the stream sequence of the message the
// state applied last (durable delivery; 0 when the state says none).
func (s *Store) LoadEntitySeq(ctx context.Context, id string) ([]byte, uint64, uint64, error) {
	r, err := s.LoadEntityState(ctx, id)
	return r.Data, r.Rev, r.Seq, err
}

// EntityState is an entity's state as stored, with what is saved with
// it in the same compare-and-set.
type EntityState struct {
	Data []byte
	// Rev is the state's revision: read by LoadEntityState; the revision
	// the state must still have for SaveEntityState (0: none yet).
	Rev uint64
	// Seq is the stream sequence of the message the state applied last
	// (durable delivery; protocol.HeaderAppliedSeq), 0 for none.
	Seq uint64
	// Answers are the answers to the last keyed messages the state
	// applied, as region.Answers encodes them (protocol.HeaderAnswers),
	// "" for none.
	Answers string
}

// LoadEntityState is LoadEntity, with what was saved with the state.
func (s *Store) LoadEntityState(ctx context.Context, id string) (EntityState, error) {
	if err := checkEntityID(id); err != nil {
		return EntityState{}, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	key := EntityKey(id)
	r, err := s.last(ctx, key)
	if err != nil {
		return EntityState{}, translate(fmt.Errorf("read %s: %w", key, err), ErrConflict)
	}
	if r.deleted {
		return EntityState{}, fmt.Errorf("%w: %s deleted at revision %d", ErrNotFound, key, r.rev)
	}
	return EntityState{Data: r.value, Rev: r.rev, Seq: r.seq, Answers: r.answers}, nil
}

// SaveEntitySeq is SaveEntity that stores, with the state and in the same
// compare-and-set, seq: the stream sequence of the message it applied
// (durable delivery). A state saved so can tell a message given again
// after a crash (LoadEntitySeq) and skip it.
func (s *Store) SaveEntitySeq(ctx context.Context, id string, data []byte, rev, seq uint64) (uint64, error) {
	return s.SaveEntityState(ctx, id, EntityState{Data: data, Rev: rev, Seq: seq})
}

// SaveEntityState is SaveEntity that stores, with the state and in the
// same compare-and-set, r's applied sequence and answers. An answers
// value must not hold a line break (region.Answers' JSON has none).
func (s *Store) SaveEntityState(ctx context.Context, id string, r EntityState) (uint64, error) {
	if err := checkEntityID(id); err != nil {
		return 0, err
	}
	if strings.ContainsAny(r.Answers, "\r\n") {
		return 0, fmt.Errorf("%w: save entity %q: a line break in its answers", ErrMalformed, id)
	}
	data, rev, seq := r.Data, r.Rev, r.Seq
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	key := EntityKey(id)
	hdr := nats.Header{}
	if seq > 0 {
		hdr.Set(protocol.HeaderAppliedSeq, strconv.FormatUint(seq, 10))
	}
	if r.Answers != "" {
		hdr.Set(protocol.HeaderAnswers, r.Answers)
	}
	size := msgSize(s.subject(key), 64+len(r.Answers), len(data)) // headers: the applied sequence, a TTL marker, the answers
	if err := s.space.admit(ctx, size, true); err == nil {
		defer s.space.end(size)
	} else if !s.shrinks(ctx, key, rev, data) {
		s.spaceLog.refused(err)
		return 0, fmt.Errorf("save entity %q at revision %d: %w", id, rev, err)
	} else {
		defer s.space.add(size) // let through: it adds no bytes, counted all the same until the next read
	}
	var (
		newRev uint64
		err    error
	)
	if rev == 0 {
		newRev, err = s.createWith(ctx, key, data, 0, hdr)
	} else {
		newRev, err = s.cas(ctx, key, data, hdr, key, rev)
	}
	if err != nil {
		err = translate(fmt.Errorf("save entity %q at revision %d: %w", id, rev, err), ErrConflict)
		if errors.Is(err, ErrNoSpace) {
			err = fmt.Errorf("stream KV_%s: %w", s.bucket, err)
		}
		return 0, err
	}
	return newRev, nil
}

// shrinks says whether writing data over key's state at revision rev
// adds no bytes: such a write is let through a full budget (it may be
// what frees space). It reads the key from the stream leader, only for
// writes the budget refused.
func (s *Store) shrinks(ctx context.Context, key string, rev uint64, data []byte) bool {
	if rev == 0 {
		return false
	}
	r, err := s.last(ctx, key)
	return err == nil && !r.deleted && r.rev == rev && len(data) <= len(r.value)
}

// DeleteEntity deletes an entity's state if its revision is still rev.
//
// The deletion is a purge whose marker expires after a few minutes, so a
// deleted entity leaves nothing in the bucket for long. With rev 0 it
// succeeds when the entity has no state, and fails with ErrConflict when it
// has.
func (s *Store) DeleteEntity(ctx context.Context, id string, rev uint64) error {
	if err := checkEntityID(id); err != nil {
		return err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	key := EntityKey(id)
	if rev == 0 {
		_, cur, err := s.load(ctx, key)
		switch {
		case errors.Is(err, ErrNotFound):
			return nil
		case err != nil:
			return err
		default:
			return fmt.Errorf("%w: delete entity %q at revision 0, it has state at revision %d", ErrConflict, id, cur)
		}
	}
	if err := s.tombstone(ctx, key, rev, true, key); err != nil {
		return translate(fmt.Errorf("delete entity %q at revision %d: %w", id, rev, err), ErrConflict)
	}
	return nil
}

// EntityKey is the KV key of an entity's state: "entities." followed by the
// id with every byte outside [A-Za-z0-9._/-] written as "=XX" (hex, upper
// case), '=' included.
//
// The escaping is injective, and its output is a valid KV key for every
// valid entity id (ids never start or end with '.' nor contain "..").
func EntityKey(id string) string {
	var b strings.Builder
	b.Grow(len(prefixEntities) + len(id))
	b.WriteString(prefixEntities)
	escapeKey(&b, id)
	return b.String()
}

// escapeKey writes id to b with every byte outside [A-Za-z0-9._/-] written
// as "=XX" (see EntityKey).
func escapeKey(b *strings.Builder, id string) {
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(id); i++ {
		c := id[i]
		if isKeyByte(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('=')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&0x0f])
	}
}

func isKeyByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '.' || c == '_' || c == '/' || c == '-'
}

// checkEntityID refuses ids that cannot address an entity
// (protocol.ValidateEntityID): among others, ids whose key would not be a
// valid KV key (empty, starting or ending with '.', containing "..").
func checkEntityID(id string) error { return protocol.ValidateEntityID(id) }
