package protocol

import (
	"errors"
	"strings"
	"testing"
)

// Hostile length prefixes must be refused before the decoder allocates
// what they announce (an out-of-memory crash found by FuzzDecodeCommand).
func TestDecodeRefusesHostileLengths(t *testing.T) {
	deep := strings.Repeat("\x91", 40) + "\x01" // 40 nested one-element arrays
	for name, data := range map[string][]byte{
		"array32 of 4G":    {0x81, 0xa1, 's', 0xdd, 0xff, 0xff, 0xff, 0xff},
		"str32 of 4G":      {0x81, 0xa1, 'i', 0xdb, 0xff, 0xff, 0xff, 0xff},
		"map32 of 4G":      {0xdf, 0xff, 0xff, 0xff, 0xff},
		"bin32 of 4G":      {0x81, 0xa1, 'x', 0xc6, 0xff, 0xff, 0xff, 0xff},
		"ext32 of 4G":      {0xc9, 0xff, 0xff, 0xff, 0xff, 0x01},
		"array16 too long": {0xdc, 0x00, 0x05, 0x01},
		"truncated str":    {0xa5, 'a', 'b'},
		"trailing bytes":   {0x80, 0x00},
		"never-used byte":  {0xc1},
		"too deep":         []byte(deep),
	} {
		var c Command
		if err := Decode(data, &c); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err %v, want ErrMalformed", name, err)
		}
	}
}

func TestDecodeRoundTrips(t *testing.T) {
	for _, v := range []any{
		Command{Kind: CmdBind, Epoch: 1 << 40, Coordinator: "c", Incarnation: "i", Shards: []int{0, 127, 65535}},
		Reply{Epoch: 3, Incarnation: "x", Held: []int{1}, Error: strings.Repeat("e", 70000)},
		ShardRecord{Shard: 5, Region: "r", Incarnation: "i", State: StateActive, Order: 9, Epoch: 2},
		RegionInfo{ID: "r", Incarnation: "i", Version: "1.2.3", Leaving: true, Started: -1},
		CoordinatorInfo{Region: "r", Incarnation: "i", Since: 1 << 50, Epoch: 7},
		TypeConfig{Shards: 128},
		Reply{Epoch: 3, Incarnation: "x", Held: []int{1, 2}, Load: []ShardLoad{{Shard: 1, Rate: 12.5, Entities: 3}, {Shard: 2}}},
		Pin{Shard: 7, Region: "b"},
	} {
		data, err := Encode(v)
		if err != nil {
			t.Fatal(err)
		}
		if err := wellFormed(data); err != nil {
			t.Errorf("%T: our own encoding is not well formed: %v", v, err)
		}
	}
	var c Command
	data, _ := Encode(Command{Kind: CmdDrop, Epoch: 4, Shards: []int{2}})
	if err := Decode(data, &c); err != nil || c.Kind != CmdDrop || c.Epoch != 4 || c.Shards[0] != 2 {
		t.Fatalf("decode: %+v %v", c, err)
	}
}

// Load reports are a new field of Reply: a coordinator that predates them
// decodes a reply with loads, and a reply without loads decodes into the
// new Reply with none.
func TestReplyLoadIsCompatible(t *testing.T) {
	type oldReply struct {
		Epoch       uint64 `msgpack:"e"`
		Incarnation string `msgpack:"i"`
		Held        []int  `msgpack:"h,omitempty"`
		Error       string `msgpack:"x,omitempty"`
		Complete    bool   `msgpack:"c,omitempty"`
	}
	data, err := Encode(Reply{Epoch: 3, Incarnation: "x", Held: []int{4}, Load: []ShardLoad{{Shard: 4, Rate: 2, Entities: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	var old oldReply
	if err := Decode(data, &old); err != nil || old.Epoch != 3 || len(old.Held) != 1 {
		t.Fatalf("old decoder: %+v %v", old, err)
	}
	data, _ = Encode(oldReply{Epoch: 3, Incarnation: "x", Held: []int{4}})
	var r Reply
	if err := Decode(data, &r); err != nil || r.Load != nil || r.Held[0] != 4 {
		t.Fatalf("new decoder, old reply: %+v %v", r, err)
	}
	data, _ = Encode(Reply{Epoch: 3, Incarnation: "x", Load: []ShardLoad{{Shard: 4, Rate: 2.5, Entities: 1}}})
	if err := Decode(data, &r); err != nil || len(r.Load) != 1 || r.Load[0] != (ShardLoad{Shard: 4, Rate: 2.5, Entities: 1}) {
		t.Fatalf("round trip: %+v %v", r, err)
	}
}

func TestDecodeJSON(t *testing.T) {
	var req PinRequest
	if err := DecodeJSON([]byte(`{"shard":3,"region":"b"}`), &req); err != nil || req != (PinRequest{Shard: 3, Region: "b"}) {
		t.Fatalf("%+v %v", req, err)
	}
	for _, bad := range []string{``, ` `, `{"shard":3,"regoin":"b"}`, `{"shard":3} {}`, `{"shard":"3"}`, `[`} {
		if err := DecodeJSON([]byte(bad), &req); err == nil || !strings.Contains(err.Error(), "bad request") {
			t.Errorf("%q: %v, want a bad request error", bad, err)
		}
	}
}
