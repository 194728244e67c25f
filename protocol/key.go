package protocol

import (
	"strings"

	"github.com/nats-io/nats.go"
)

// UniqueReplyMark starts the last token of a reply subject that its
// sender promises no other message carries, such as
// "_INBOX.kQ3x9.~4fz1k2": the reply subject is then the message's key
// (MessageKey), as a Nats-Msg-Id would be. natshard's Client sends its
// core requests so, without a header: a header costs a map on both sides
// (issue 14), and the unique reply subject that a request has anyway
// does the same work.
const UniqueReplyMark = "~"

// MessageKey is what tells a message from the copies of it that a
// handoff can make (the old owner buffers it while the new one holds it;
// PROTOCOL.md): its Nats-Msg-Id, or else its reply subject when the
// last token of that starts with UniqueReplyMark; "" when it has
// neither, so that a copy of it cannot be told from another message with
// the same contents. Any other reply subject is no key: a publisher may
// give many messages one reply subject, and skipping them as copies
// would lose them.
func MessageKey(h nats.Header, reply string) string {
	if id := h.Get(HeaderMsgID); id != "" {
		return id
	}
	if last := reply[strings.LastIndexByte(reply, '.')+1:]; strings.HasPrefix(last, UniqueReplyMark) {
		return reply
	}
	return ""
}

// IdempotencyKey is the key a message's sender gave it so that it is
// applied once however often it is sent (natshard's MsgID): its
// Nats-Msg-Id, unless the sender marked that unique with a leading
// UniqueReplyMark (natshard's Client does for the keys it makes itself,
// which it never sends again in another call) or the message is a
// reminder's. An entity's runtime keeps the answers to the messages with
// such keys and answers a message with a key it has seen with the first
// answer. A copy that a split's forwarding made carries its original's
// key in HeaderKey. "" when the message has none; it reads no header when
// h is nil.
func IdempotencyKey(h nats.Header) string {
	if h == nil {
		return ""
	}
	if k := h.Get(HeaderKey); k != "" {
		return k // a forwarded copy's (HeaderForwarded)
	}
	id := h.Get(HeaderMsgID)
	if id == "" || strings.HasPrefix(id, UniqueReplyMark) || h.Get(HeaderReminder) != "" {
		return ""
	}
	return id
}
