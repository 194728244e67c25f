package natshard

import (
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/send"
)

// The sending half of natshard lives in package send, which a program
// that only sends imports without linking the NATS server; these are its
// names in this package, for programs that host entities too.

// DefaultTimeout bounds a Client's call whose context has no deadline.
const DefaultTimeout = send.DefaultTimeout

// Client sends messages to entities of any type (send.Client).
type Client = send.Client

// A ClientOption configures a Client.
type ClientOption = send.ClientOption

// A SendOption configures one message.
type SendOption = send.SendOption

// EntityError is an entity's error answer (send.EntityError).
type EntityError = send.EntityError

// EntityRef is an entity of a type, to send bytes to: Client.Entity.
type EntityRef = send.EntityRef

// NewClient returns a client on nc (send.NewClient). The connection stays
// the caller's.
func NewClient(nc *nats.Conn, opts ...ClientOption) *Client { return send.NewClient(nc, opts...) }

// WithPrefix sets the data-plane subject prefix of the types (send.WithPrefix).
func WithPrefix(data string) ClientOption { return send.WithPrefix(data) }

// WithTimeout bounds the calls whose context has no deadline (send.WithTimeout).
func WithTimeout(d time.Duration) ClientOption { return send.WithTimeout(d) }

// WithResend sends a core request again, with the same key, when no
// answer came after d (send.WithResend).
func WithResend(d time.Duration) ClientOption { return send.WithResend(d) }

// MsgID sets the message's idempotency key (send.MsgID).
func MsgID(key string) SendOption { return send.MsgID(key) }

// Header adds the headers h to the message (send.Header).
func Header(h nats.Header) SendOption { return send.Header(h) }
