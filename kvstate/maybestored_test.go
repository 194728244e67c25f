package kvstate

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestMaybeStored: an Append that got no acknowledgement may be stored
// (the campaign found messages refused for "no response from stream"
// replayed and handled, issue 30); one the server refused, or that was
// never sent, is not. Each error as Append's failed callback gets it
// (bufferErr).
func TestMaybeStored(t *testing.T) {
	full := &jetstream.APIError{Code: 503, ErrorCode: codeStoreFailed, Description: msgMaxPerSubject}
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"ack timed out", bufferErr(jetstream.ErrAsyncPublishTimeout), true},
		{"no response from stream", bufferErr(jetstream.ErrNoStreamResponse), true},
		{"connection closed", bufferErr(nats.ErrConnectionClosed), true},
		{"context ended", bufferErr(fmt.Errorf("publish: %w", context.DeadlineExceeded)), true},
		{"buffer full", bufferErr(full), false},
		{"server refused", bufferErr(&jetstream.APIError{Code: 400, ErrorCode: 10071, Description: "wrong last sequence"}), false},
		{"too many pending", bufferErr(jetstream.ErrTooManyStalledMsgs), false},
		{"no space reserved", fmt.Errorf("%w: buffer near its limit", ErrNoSpace), false},
		{"too large", bufferErr(fmt.Errorf("kvstate: a message does not fit: %w", nats.ErrMaxPayload)), false},
		{"no subject", errors.New("kvstate: append of a message without subject"), false},
		{"nil", nil, false},
	} {
		if got := MaybeStored(c.err); got != c.want {
			t.Errorf("%s (%v): MaybeStored %v, want %v", c.name, c.err, got, c.want)
		}
	}
}
