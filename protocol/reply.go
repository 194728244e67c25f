package protocol

import (
	"encoding/json"
	"errors"

	"github.com/nats-io/nats.go"
)

// ErrorReply builds the answer natshard sends to a request it could not
// handle: the header Natshard-Error with err's text, and body, or, when body
// is nil, the JSON {"ok":false,"error":"<err>"}. Every part of natshard that
// refuses a request (a region, the parking coordinator) answers this way.
func ErrorReply(subject string, body []byte, err error) *nats.Msg {
	return RefusedReply(subject, "", body, err)
}

// Reasons for refusing a message, the values of HeaderRefused.
const (
	// RefusedMalformed: the subject is not an entity's of this type, or
	// names the wrong shard. Sending it again cannot help.
	RefusedMalformed = "malformed"
	// RefusedNotOwned: the region that got it does not serve its shard
	// (any more): the shard moved, or is moving. Regions no longer send
	// it (since 2026-11-29 they drop such a message unanswered: its next
	// holder may answer its own copy); clients still take it from older
	// regions.
	RefusedNotOwned = "not-owned"
	// RefusedMoving: the shard is moving and its buffer is full, or its
	// source holds too many messages while it pauses, or the message could
	// not be buffered (before the source stopped its entities).
	RefusedMoving = "moving"
	// RefusedStopping: the shard's entities are stopping (it is leaving
	// the region).
	RefusedStopping = "stopping"
	// RefusedNoAnswer: a request for the answer of a key
	// (HeaderAnswerOf) whose answer its entity does not keep: applied
	// before the entity's window of answers, or never applied (it failed
	// before its entity handled it). Asking again cannot help.
	RefusedNoAnswer = "no-answer"
)

// RefusedReply is ErrorReply for a message that no entity handled, with
// HeaderRefused set to reason (none when reason is empty).
func RefusedReply(subject, reason string, body []byte, err error) *nats.Msg {
	out := nats.NewMsg(subject)
	out.Header.Set(HeaderError, err.Error())
	if reason != "" {
		out.Header.Set(HeaderRefused, reason)
	}
	code := ErrorCode(err)
	if code != "" {
		out.Header.Set(HeaderErrorCode, code)
	}
	out.Data = body
	if out.Data == nil {
		if code != "" {
			out.Data, _ = json.Marshal(map[string]any{"ok": false, "error": err.Error(), "code": code})
		} else {
			out.Data, _ = json.Marshal(map[string]any{"ok": false, "error": err.Error()})
		}
	}
	return out
}

// ErrorCode is the code of err (HeaderErrorCode): that of the first error
// in its chain with a method ErrorCode() string, when it is a valid code
// (ValidErrorCode); "" otherwise.
func ErrorCode(err error) string {
	var coded interface{ ErrorCode() string }
	if err == nil || !errors.As(err, &coded) {
		return ""
	}
	if code := coded.ErrorCode(); ValidErrorCode(code) {
		return code
	}
	return ""
}

// ValidErrorCode reports whether code may be an error code: 1 to 64
// ASCII letters, digits, '-', '_', '.' or ':'.
func ValidErrorCode(code string) bool {
	if code == "" || len(code) > 64 {
		return false
	}
	for _, r := range []byte(code) {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.', r == ':':
		default:
			return false
		}
	}
	return true
}

// CodedError is an error with a code (ErrorCode), as an error answer
// read back (a kept answer, a sidecar app's) carries it.
type CodedError struct {
	Code, Text string
}

func (e *CodedError) Error() string     { return e.Text }
func (e *CodedError) ErrorCode() string { return e.Code }
