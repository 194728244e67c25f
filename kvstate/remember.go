package kvstate

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Remembered entities (natshard's Type.Remember): the ids of a type's
// active entities, one key per entity under its shard,
//
//	remember.<shard>.<escaped id>    empty value (the escaping of EntityKey)
//
// so that a shard's new owner lists the shard's keys and starts those
// entities again. A forgotten entity's key is purged with a marker that
// expires (markerTTL), so entities that come and go leave nothing behind.

// prefixRemember is the prefix of the remembered entities' keys.
const prefixRemember = "remember."

// EntityRecord is one change of the remembered entities: entity ID of
// Shard is now active, or, with Forget, no longer.
type EntityRecord struct {
	Shard  int
	ID     string
	Forget bool
}

// RecordEntities writes the changes in order, pipelined (one publish each,
// then the acknowledgements), and returns once every change is stored, or
// with the first error (the changes before it may be stored; writing a
// change again is harmless).
func (s *Store) RecordEntities(ctx context.Context, recs []EntityRecord) error {
	for _, r := range recs {
		if err := checkShard(r.Shard); err != nil {
			return err
		}
		if err := checkEntityID(r.ID); err != nil {
			return err
		}
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	acks := make([]jetstream.PubAckFuture, 0, len(recs))
	var err error
	for _, r := range recs {
		m := &nats.Msg{Subject: s.subject(rememberKey(r.Shard, r.ID))}
		if r.Forget {
			m.Header = nats.Header{}
			m.Header.Set(hdrKVOp, kvOpPurge)
			m.Header.Set(hdrRollup, rollupSubject)
			m.Header.Set(jetstream.MsgTTLHeader, ttlHeader(int64(markerTTL/time.Second)))
		}
		var f jetstream.PubAckFuture
		if f, err = s.js.PublishMsgAsync(m); err != nil {
			break
		}
		acks = append(acks, f)
	}
	for _, f := range acks {
		select {
		case <-f.Ok():
		case ferr := <-f.Err():
			err = errors.Join(err, ferr)
		case <-ctx.Done():
			err = errors.Join(err, ctx.Err())
		}
		if err != nil {
			break
		}
	}
	if err != nil {
		return translate(fmt.Errorf("record %d remembered entities: %w", len(recs), err), ErrConflict)
	}
	return nil
}

// RememberedEntities lists the remembered entities of shard, every write
// made before the call included (see list), in key order.
func (s *Store) RememberedEntities(ctx context.Context, shard int) ([]string, error) {
	if err := checkShard(shard); err != nil {
		return nil, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	prefix := rememberPrefix(shard)
	entries, err := s.list(ctx, prefix+">")
	if err != nil {
		return nil, translate(fmt.Errorf("list the remembered entities of shard %d: %w", shard, err), ErrConflict)
	}
	ids := make([]string, 0, len(entries))
	for _, e := range entries {
		if id, ok := unescapeKey(strings.TrimPrefix(e.Key(), prefix)); ok && checkEntityID(id) == nil {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

func rememberPrefix(shard int) string { return prefixRemember + strconv.Itoa(shard) + "." }

func rememberKey(shard int, id string) string {
	var b strings.Builder
	prefix := rememberPrefix(shard)
	b.Grow(len(prefix) + len(id))
	b.WriteString(prefix)
	escapeKey(&b, id)
	return b.String()
}

// unescapeKey undoes escapeKey; false when s is not an escaped id.
func unescapeKey(s string) (string, bool) {
	if !strings.Contains(s, "=") {
		return s, true
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '=' {
			b.WriteByte(s[i])
			continue
		}
		if i+3 > len(s) {
			return "", false
		}
		v, err := strconv.ParseUint(s[i+1:i+3], 16, 8)
		if err != nil {
			return "", false
		}
		b.WriteByte(byte(v))
		i += 2
	}
	return b.String(), true
}
