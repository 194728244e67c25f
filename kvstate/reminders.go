package kvstate

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

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
	m.Header.Set(jsScheduleTarget, s.fired(shard, id))
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

// fired is the subject a due reminder of entity id in shard is stored on
// in the reminders' stream: with several message streams, one that names
// the shard's stream, whose source takes it (FiredIn).
func (s *Stream) fired(shard int, id string) string {
	if len(s.names) == 1 {
		return s.subjects.Fired(shard, id)
	}
	return s.subjects.FiredIn(shard%len(s.names), shard, id)
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
