package send

import (
	"errors"
	"fmt"
)

// Error is an error an entity type declares, with a code that crosses the
// wire: an entity returns it (or an error wrapping it, or a copy with
// details: WithDetails), its requester gets an *EntityError with the same
// code, and errors.Is(err, declared) holds on both sides. Declare them
// beside the type's requests and replies, in the package its senders and
// its hosts share:
//
//	var ErrInsufficientFunds = send.NewError("insufficient-funds", "insufficient funds")
//
// The code is the answer's Natshard-Error-Code header and the message its
// Natshard-Error header, for a requester in any language
// (docs/PROTOCOL.md, "Headers"). A code is 1 to 64 ASCII letters, digits,
// '-', '_', '.' or ':'; an error with another code is answered as one
// without a code.
type Error struct {
	code, message string
	details       any // WithDetails's, encoded as the answer's body
}

// NewError returns an error with code and message (the error's text;
// the code when empty).
func NewError(code, message string) *Error { return &Error{code: code, message: message} }

// Errors natshard's typed entity types answer with.
var (
	// ErrBadRequest: the request's body could not be decoded into the
	// type's request (code "bad-request"). Sending it again cannot help.
	ErrBadRequest = NewError("bad-request", "bad request")
)

// Code is the error's code.
func (e *Error) Code() string { return e.code }

// ErrorCode is the error's code (what protocol.ErrorCode reads).
func (e *Error) ErrorCode() string { return e.code }

// Message is the error's text without its code.
func (e *Error) Message() string { return e.message }

// Details are the details WithDetails gave the error, nil if none.
func (e *Error) Details() any { return e.details }

func (e *Error) Error() string {
	if e.message == "" {
		return e.code
	}
	return e.message
}

// Is reports whether target is an error with e's code (an *Error, an
// *EntityError): the same declared error.
func (e *Error) Is(target error) bool {
	t, ok := target.(interface{ ErrorCode() string })
	return ok && e.code != "" && t.ErrorCode() == e.code
}

// WithDetails returns a copy of e with details: a typed entity's answer
// carries them as its body, encoded by the type's codec, and its
// requester decodes them with Key.Details.
func (e *Error) WithDetails(details any) *Error {
	c := *e
	c.details = details
	return &c
}

// Errorf returns a copy of e whose message is format's, with args (%w
// wraps as fmt.Errorf does): the same code, a text that says more.
func (e *Error) Errorf(format string, args ...any) error {
	f := fmt.Errorf(format, args...)
	return &wrapped{base: e, text: f.Error(), cause: errors.Unwrap(f)}
}

// wrapped is Errorf's error: e's code, its own text.
type wrapped struct {
	base  *Error
	text  string
	cause error
}

func (w *wrapped) Error() string     { return w.text }
func (w *wrapped) ErrorCode() string { return w.base.code }

func (w *wrapped) Unwrap() []error {
	if w.cause == nil {
		return []error{w.base}
	}
	return []error{w.base, w.cause}
}

// EntityError is an entity's error answer: its Handle (or its Factory)
// returned an error. Test for it with errors.As, and for the error an
// entity type declared with errors.Is (the same Code).
type EntityError struct {
	Type, ID string
	Code     string // the error's code (the Natshard-Error-Code header), "" if it has none
	Message  string // the error's text (the Natshard-Error header)
	Data     []byte // the answer's body
}

func (e *EntityError) Error() string {
	return fmt.Sprintf("natshard: entity %s of type %s: %s", e.ID, e.Type, e.Message)
}

// ErrorCode is the error's code, "" if it has none.
func (e *EntityError) ErrorCode() string { return e.Code }

// Is reports whether target is an error with e's code (an error a type
// declared with NewError).
func (e *EntityError) Is(target error) bool {
	t, ok := target.(interface{ ErrorCode() string })
	return ok && e.Code != "" && t.ErrorCode() == e.Code
}

// As sets *target, an **Error, to an Error with e's code and message
// (without details: Key.Details decodes them from Data).
func (e *EntityError) As(target any) bool {
	t, ok := target.(**Error)
	if !ok || e.Code == "" {
		return false
	}
	*t = &Error{code: e.Code, message: e.Message}
	return true
}
