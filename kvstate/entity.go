package kvstate

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/natshard/natshard/protocol"
)

// LoadEntity reads an entity's persisted state from the stream leader.
// ErrNotFound when it has none.
func (s *Store) LoadEntity(ctx context.Context, id string) ([]byte, uint64, error) {
	if err := checkEntityID(id); err != nil {
		return nil, 0, err
	}
	return s.load(ctx, EntityKey(id))
}

// SaveEntity writes an entity's state if its revision is still rev (0: the
// entity has no state yet). ErrConflict otherwise. Returns the new revision.
//
// With rev 0 the write succeeds when the entity never had state and when
// its state was deleted.
func (s *Store) SaveEntity(ctx context.Context, id string, data []byte, rev uint64) (uint64, error) {
	if err := checkEntityID(id); err != nil {
		return 0, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	key := EntityKey(id)
	var (
		newRev uint64
		err    error
	)
	if rev == 0 {
		newRev, err = s.create(ctx, key, data, 0)
	} else {
		newRev, err = s.cas(ctx, key, data, nil, key, rev)
	}
	if err != nil {
		return 0, translate(fmt.Errorf("save entity %q at revision %d: %w", id, rev, err), ErrConflict)
	}
	return newRev, nil
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
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(prefixEntities) + len(id))
	b.WriteString(prefixEntities)
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
	return b.String()
}

func isKeyByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '.' || c == '_' || c == '/' || c == '-'
}

// checkEntityID refuses ids that cannot address an entity
// (protocol.ValidateEntityID): among others, ids whose key would not be a
// valid KV key (empty, starting or ending with '.', containing "..").
func checkEntityID(id string) error { return protocol.ValidateEntityID(id) }
