package protocol

import (
	"encoding/json"

	"github.com/nats-io/nats.go"
)

// ErrorReply builds the answer natshard sends to a request it could not
// handle: the header Natshard-Error with err's text, and body, or, when body
// is nil, the JSON {"ok":false,"error":"<err>"}. Every part of natshard that
// refuses a request (a region, the parking coordinator) answers this way.
func ErrorReply(subject string, body []byte, err error) *nats.Msg {
	out := nats.NewMsg(subject)
	out.Header.Set(HeaderError, err.Error())
	out.Data = body
	if out.Data == nil {
		out.Data, _ = json.Marshal(map[string]any{"ok": false, "error": err.Error()})
	}
	return out
}
