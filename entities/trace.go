package entities

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/region"
)

// Trace returns the factory of trace entities, a diagnostic kind: like echo
// each answers its payload, and for every message it publishes a record to
// subject:
//
//	<entity id> <region> <incarnation> <start ns> <end ns> <payload>
//
// region is the region's id, incarnation is unique per activation of the
// entity, start and end are wall-clock nanoseconds around the handling.
// Subscribing to subject shows where and when each message ran; the
// integration load test uses it to prove per-entity order and single
// ownership.
func Trace(publish func(subject string, data []byte) error, subject, regionID string) region.Factory {
	return func(_ context.Context, id string) (region.Entity, error) {
		return &traceEntity{publish: publish, subject: subject, prefix: id + " " + regionID + " " + nuid.Next() + " "}, nil
	}
}

type traceEntity struct {
	publish func(string, []byte) error
	subject string
	prefix  string // "<id> <region> <incarnation> "
}

func (e *traceEntity) Handle(_ context.Context, m *region.Message) ([]byte, error) {
	start := time.Now().UnixNano()
	rec := make([]byte, 0, len(e.prefix)+48+len(m.Data))
	rec = append(rec, e.prefix...)
	rec = strconv.AppendInt(rec, start, 10)
	rec = append(rec, ' ')
	rec = strconv.AppendInt(rec, time.Now().UnixNano(), 10)
	rec = append(rec, ' ')
	rec = append(rec, m.Data...)
	return m.Data, e.publish(e.subject, rec)
}

func (e *traceEntity) Stop(context.Context) error { return nil }
