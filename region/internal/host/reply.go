package host

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// Publisher sends the answers to requests; *nats.Conn is one. It must be
// safe for concurrent use: every worker answers through it.
type Publisher interface {
	Publish(subject string, data []byte) error
	PublishMsg(m *nats.Msg) error
	MaxPayload() int64
}

// Answer answers request m with data, or, when err is not nil, with err
// in the Natshard-Error header (and a refusal's reason, Refused, in the
// Natshard-Refused header). A plain publish (no reply subject) gets no
// answer. An answer larger than the server's max_payload is replaced by
// an error saying so, sent instead of leaving the requester to time out;
// Answer returns that error (for the caller to log), nil otherwise.
func Answer(p Publisher, m *nats.Msg, data []byte, err error) (tooLarge error) {
	if m.Reply == "" || p == nil {
		return nil
	}
	if err == nil {
		err = p.Publish(m.Reply, data)
		if !errors.Is(err, nats.ErrMaxPayload) {
			return nil
		}
		err = fmt.Errorf("answer of %d bytes exceeds the NATS max_payload of %d bytes", len(data), p.MaxPayload())
		tooLarge, data = err, nil
	}
	var rf *refusal
	reason := ""
	if errors.As(err, &rf) {
		reason = rf.reason
	}
	_ = p.PublishMsg(protocol.RefusedReply(m.Reply, reason, data, err))
	return tooLarge
}

// refusal is the error of a message that no entity handled; reason is
// one of protocol's Refused* values. Sending such a message again is safe
// (but for a malformed one, useless).
type refusal struct {
	reason string
	err    error
}

// Refused returns err as a refusal with reason (one of protocol's
// Refused* values): Answer sends the reason in the Natshard-Refused
// header.
func Refused(reason string, err error) error { return &refusal{reason: reason, err: err} }

func (r *refusal) Error() string { return r.err.Error() }
func (r *refusal) Unwrap() error { return r.err }

// rareLog logs a rare problem of the host at most once per logEvery,
// with the number of occurrences since its last line.
type rareLog struct {
	last atomic.Int64 // unix nanoseconds of the last line
	n    atomic.Int64
}

const logEvery = 10 * time.Second

func (r *rareLog) warn(h *Host, msg string, args ...any) {
	n := r.n.Add(1)
	now, last := time.Now().UnixNano(), r.last.Load()
	if now-last < int64(logEvery) || !r.last.CompareAndSwap(last, now) {
		return
	}
	r.n.Add(-n)
	h.log.Warn(msg, append(args, "occurrences", n)...)
}
