package send

import (
	"encoding/json"

	"github.com/vmihailenco/msgpack/v5"
)

// Codec encodes the requests and replies of a typed entity type (Key),
// and the details of its errors: JSON by default, Msgpack as an option,
// or a codec of the user's. Its methods are called concurrently.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// Codecs.
var (
	// JSON is encoding/json: the default, what `nats req` and a
	// publisher in any language send most easily.
	JSON Codec = jsonCodec{}
	// Msgpack is github.com/vmihailenco/msgpack/v5: smaller and faster,
	// binary.
	Msgpack Codec = msgpackCodec{}
)

type jsonCodec struct{}

func (jsonCodec) Marshal(v any) ([]byte, error)      { return json.Marshal(v) }
func (jsonCodec) Unmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }

type msgpackCodec struct{}

func (msgpackCodec) Marshal(v any) ([]byte, error)      { return msgpack.Marshal(v) }
func (msgpackCodec) Unmarshal(data []byte, v any) error { return msgpack.Unmarshal(data, v) }
