package kvstate

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// JetStream API error codes that matter here (nats-server
// jetstream_errors_generated.go).
const (
	// codeWrongLastSeq: "wrong last sequence: {seq}", an expected-last-
	// sequence check failed against the stored state. It is the only code a
	// single server (R1) uses for it.
	codeWrongLastSeq = jetstream.JSErrCodeStreamWrongLastSequence // 10071
	// codeWrongLastSeqConst: "wrong last sequence" without a sequence. A
	// replicated stream (R>1) answers it, before proposing the write, when
	// the subject the check is made on has another write in flight (proposed
	// to the stream's raft group, not yet applied). It does NOT mean that
	// the check failed: the write in flight may itself fail. See
	// checkMsgHeadersPreClusteredProposal in jetstream_batching.go.
	codeWrongLastSeqConst = jetstream.JSErrCodeStreamWrongLastSequenceConstant // 10164
	// codeNoMessage: the message (or last message of a subject) is not in the
	// stream.
	codeNoMessage = jetstream.JSErrCodeMessageNotFound // 10037

	// Atomic batch publish (PutShards); nats.go names none of them.
	codeAtomicDisabled  = 10174 // the stream does not allow atomic batches
	codeBatchIncomplete = 10176 // a message of the batch was lost: nothing was written
	codeBatchTooLarge   = 10199 // more messages than the server's max_batch_size
)

// translate is the one place where NATS and JetStream errors become the
// package's sentinel errors. conflict is what a failed compare-and-set
// means for the caller: ErrConflict, or ErrFenced for fenced writes. The
// original error stays wrapped, so errors.Is works for both. Errors that are
// already translated, and errors of unknown kind, are returned unchanged.
func translate(err error, conflict error) error {
	if err == nil {
		return nil
	}
	for _, own := range []error{ErrNotFound, ErrConflict, ErrFenced, ErrConfigMismatch, ErrUnavailable, ErrMalformed} {
		if errors.Is(err, own) {
			return err
		}
	}
	if cause := noSpaceCause(err); cause != "" {
		return fmt.Errorf("%w: %s: %w", ErrNoSpace, cause, err)
	}
	var kind error
	switch {
	case errors.Is(err, protocol.ErrMalformed):
		kind = ErrMalformed
	case errors.Is(err, jetstream.ErrKeyNotFound),
		errors.Is(err, jetstream.ErrKeyDeleted),
		errors.Is(err, jetstream.ErrMsgNotFound),
		apiCode(err) == codeNoMessage:
		kind = ErrNotFound
	case isWrongLastSeq(err),
		errors.Is(err, jetstream.ErrKeyRevisionMismatch):
		kind = conflict
	case isUnavailable(err):
		kind = ErrUnavailable
	default:
		return err
	}
	return fmt.Errorf("%w: %w", kind, err)
}

// isWrongLastSeq reports an expected-last-sequence refusal (either code).
func isWrongLastSeq(err error) bool {
	c := apiCode(err)
	return c == codeWrongLastSeq || c == codeWrongLastSeqConst
}

// isSubjectBusy reports the R>1 refusal that only says another write to the
// checked subject is in flight (see codeWrongLastSeqConst).
func isSubjectBusy(err error) bool { return apiCode(err) == codeWrongLastSeqConst }

func isUnavailable(err error) bool {
	for _, e := range []error{
		context.DeadlineExceeded,
		context.Canceled,
		nats.ErrTimeout,
		nats.ErrNoResponders,
		nats.ErrConnectionClosed,
		nats.ErrConnectionDraining,
		nats.ErrConnectionReconnecting,
		nats.ErrDisconnected,
		nats.ErrNoServers,
		nats.ErrBadSubscription, // a subscription on a closed connection
		nats.ErrJetStreamNotEnabled,
		nats.ErrJetStreamNotEnabledForAccount,
		jetstream.ErrNoStreamResponse,
		jetstream.ErrJetStreamNotEnabled,
		jetstream.ErrJetStreamNotEnabledForAccount,
		jetstream.ErrConnectionClosed,
		jetstream.ErrServerShutdown,
		jetstream.ErrNoHeartbeat,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	// 503: JetStream (or the stream's raft group) not available, no
	// leader, not enough resources right now. 408: request timed out in the
	// server.
	c := apiStatus(err)
	return c == 503 || c == 408
}

// apiCode is the JetStream API error code in err's chain, 0 if none. The KV
// and publish paths report *jetstream.APIError; watches are built on the
// legacy nats.JetStreamContext, which reports *nats.APIError.
func apiCode(err error) jetstream.ErrorCode {
	var a *jetstream.APIError
	if errors.As(err, &a) {
		return a.ErrorCode
	}
	var l *nats.APIError
	if errors.As(err, &l) {
		return jetstream.ErrorCode(l.ErrorCode)
	}
	return 0
}

// apiStatus is the HTTP-like status of the JetStream API error in err's
// chain, 0 if none.
func apiStatus(err error) int {
	var a *jetstream.APIError
	if errors.As(err, &a) {
		return a.Code
	}
	var l *nats.APIError
	if errors.As(err, &l) {
		return l.Code
	}
	return 0
}
