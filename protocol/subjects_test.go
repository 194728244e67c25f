package protocol

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestParseEntity(t *testing.T) {
	s := MustSubjects("", "", "orders")
	for _, tc := range []struct {
		subject string
		shard   int
		id      string
		err     error
	}{
		{"shard.orders.116.order-42", 116, "order-42", nil},
		{"shard.orders.89.user.7", 89, "user.7", nil},
		{"shard.orders.44.a", 44, "a", nil},
		{"shard.orders.3.42", 3, "42", nil},
		{"shard.orders.3", 0, "", ErrInvalidSubject},      // no entity
		{"shard.orders.03.42", 0, "", ErrInvalidSubject},  // not canonical
		{"shard.orders.128.x", 0, "", ErrInvalidSubject},  // out of range
		{"shard.orders.-1.x", 0, "", ErrInvalidSubject},   // negative
		{"shard.orders.x.42", 0, "", ErrInvalidSubject},   // not a number
		{"shard.other.3.42", 0, "", ErrInvalidSubject},    // other type
		{"shard.orders.5.42", 0, "", ErrWrongShard},       // 42 is in shard 3
		{"shard.orders.3.42.", 0, "", ErrInvalidEntityID}, // empty token
		{"shard.orders.3..42", 0, "", ErrInvalidEntityID}, // empty token
		{"shard.orders.1.*", 0, "", ErrInvalidEntityID},   // wildcard
		{"shard.orders.1." + strings.Repeat("x", 300), 0, "", ErrInvalidEntityID},
	} {
		shard, id, err := s.ParseEntity(tc.subject, 128)
		if !errors.Is(err, tc.err) {
			t.Errorf("%q: err %v, want %v", tc.subject, err, tc.err)
			continue
		}
		if err == nil && (shard != tc.shard || id != tc.id) {
			t.Errorf("%q: got %d %q, want %d %q", tc.subject, shard, id, tc.shard, tc.id)
		}
	}
}

func TestValidateEntityID(t *testing.T) {
	for _, ok := range []string{"a", "order-42", "user.7", "ü", "a=b", "x:y@z"} {
		if err := ValidateEntityID(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for bad, why := range map[string]string{
		"": "empty", strings.Repeat("x", MaxEntityIDLen+1): "bytes, at most", ".a": "empty token", "a.": "ends with a dot",
		"a..b": "empty token", "a b": "white space", "a\tb": "white space", "a\x00": "control", "a\x7f": "control",
		"a*": "wildcard", ">": "wildcard", "a.>": "wildcard",
	} {
		if err := ValidateEntityID(bad); !errors.Is(err, ErrInvalidEntityID) || !strings.Contains(err.Error(), why) {
			t.Errorf("%q: err %v, want ErrInvalidEntityID saying %q", bad, err, why)
		}
	}
}

// validID is the rules of an entity id as docs/PROTOCOL.md ("Subjects") gives
// them, written plainly: the fuzzer holds hashEntityID's table to it.
func validID(id string) bool {
	if id == "" || len(id) > MaxEntityIDLen {
		return false
	}
	for _, tok := range strings.Split(id, ".") {
		if tok == "" {
			return false
		}
		for i := range len(tok) {
			if c := tok[i]; c <= ' ' || c == 0x7f || c == '*' || c == '>' {
				return false
			}
		}
	}
	return true
}

func TestNewSubjects(t *testing.T) {
	for _, tc := range []struct{ data, control, typ string }{
		{"", "", "bad type"},
		{"", "", ""},
		{"a.*", "", "t"},
		{"a..b", "", "t"},
		{"same", "same", "t"},
	} {
		if _, err := NewSubjects(tc.data, tc.control, tc.typ); !errors.Is(err, ErrInvalidName) {
			t.Errorf("%+v: err %v, want ErrInvalidName", tc, err)
		}
	}
	s := MustSubjects("app.data", "app.ctl", "kv")
	if got := s.Entity(3, "42"); got != "app.data.kv.3.42" {
		t.Errorf("Entity = %q", got)
	}
	if got := s.Shard(3); got != "app.data.kv.3.>" {
		t.Errorf("Shard = %q", got)
	}
	if got := s.Region("r1"); got != "app.ctl.kv.region.r1" {
		t.Errorf("Region = %q", got)
	}
	if got := s.Query("r1"); got != "app.ctl.kv.query.r1" {
		t.Errorf("Query = %q", got)
	}
	if got := s.Events(); got != "app.ctl.kv.events" {
		t.Errorf("Events = %q", got)
	}
	if got := s.Reminder(3, "expire", "user.7"); got != "app.ctl.kv.remind.3.expire.user.7" {
		t.Errorf("Reminder = %q", got)
	}
	if got := s.AllReminders(); got != "app.ctl.kv.remind.>" {
		t.Errorf("AllReminders = %q", got)
	}
}

// FuzzParseEntity: parsing never panics, and whatever parses round-trips.
func FuzzParseEntity(f *testing.F) {
	s := MustSubjects("", "", "kv")
	for _, seed := range []string{"shard.kv.3.42", "shard.kv.89.user.7", "shard.kv.", "shard.kv.1..", "shard.kv.999999999.x", "x", "a..b", ".a", "a.", "a b", "a*", "a>", "a\x7f", "a.b"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, subject string) {
		// The one-pass check of an id (the input as an id) follows the
		// rules written plainly, and hashes as Hash; ValidateEntityID
		// agrees and says why it refuses.
		h, ok := hashEntityID(subject)
		if ok != validID(subject) || ok && h != Hash(subject) {
			t.Fatalf("hashEntityID(%q) = %d, %t; the rules say %t", subject, h, ok, validID(subject))
		}
		if err := ValidateEntityID(subject); (err == nil) != ok || err != nil && !errors.Is(err, ErrInvalidEntityID) ||
			err != nil && strings.HasSuffix(err.Error(), "ends with a dot") && !strings.HasSuffix(subject, ".") {
			t.Fatalf("ValidateEntityID(%q) = %v; hashEntityID says %t", subject, err, ok)
		}
		if n, err := checkedShardOf(subject, 128); ok && (err != nil || n != ShardOf(subject, 128)) || !ok && err == nil {
			t.Fatalf("checkedShardOf(%q) = %d, %v", subject, n, err)
		}
		shard, id, err := s.ParseEntity(subject, 128)
		if err != nil {
			return
		}
		if s.Entity(shard, id) != subject {
			t.Fatalf("%q parsed to %d %q, which builds %q", subject, shard, id, s.Entity(shard, id))
		}
		if ValidateEntityID(id) != nil || ShardOf(id, 128) != shard {
			t.Fatalf("%q: accepted an id that does not validate", subject)
		}
	})
}

// FuzzDecodeCommand decodes arbitrary bytes as every msgpack type of the
// control plane (Command, Reply with its ShardLoads) and of KV
// (ShardRecord, RegionInfo, CoordinatorInfo, TypeConfig, Pin): decoding
// never panics nor allocates beyond the input (Decode's well-formedness
// check), what decodes re-encodes to bytes that decode to the same value,
// and a command that validates has a known kind and in-range shards.
// Seeds: testdata/fuzz/FuzzDecodeCommand, one real value of each type.
func FuzzDecodeCommand(f *testing.F) {
	for _, v := range []any{
		Command{Kind: CmdBind, Epoch: 3, Incarnation: "x", Shards: []int{1, 2}, Handoffs: []uint64{7, 8}},
		Reply{Epoch: 3, Incarnation: "x", Held: []int{1}, Load: []ShardLoad{{Shard: 1, Rate: 2.5, Entities: 3}}},
		ShardRecord{Shard: 5, Region: "r", Incarnation: "i", State: StateBinding, Order: 9, Epoch: 2, Handoff: 4, Source: "s", SourceIncarnation: "j"},
		RegionInfo{ID: "r", Incarnation: "i", Version: "1", Leaving: true, Started: 1},
		CoordinatorInfo{Region: "r", Incarnation: "i", Since: 1, Epoch: 7},
		TypeConfig{Shards: 128, Strategy: "least-shard"},
		Pin{Shard: 7, Region: "b"},
	} {
		data, err := Encode(v)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte{0xc1})
	f.Add([]byte("garbage"))
	f.Add([]byte{0x81, 0xa1, 's', 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x81, 0xa1, 'i', 0xdb, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		var c Command
		if Decode(data, &c) == nil && c.Validate(128) == nil {
			for _, s := range c.Shards {
				if s < 0 || s >= 128 {
					t.Fatalf("validated shard %d", s)
				}
			}
		}
		roundTrip(t, data, func() any { return new(Command) })
		roundTrip(t, data, func() any { return new(Reply) })
		roundTrip(t, data, func() any { return new(ShardRecord) })
		roundTrip(t, data, func() any { return new(RegionInfo) })
		roundTrip(t, data, func() any { return new(CoordinatorInfo) })
		roundTrip(t, data, func() any { return new(TypeConfig) })
		roundTrip(t, data, func() any { return new(Pin) })
	})
}

// roundTrip: if data decodes into a fresh value, its encoding decodes and
// encodes again to the same bytes (bytes, not values, so that NaN rates
// compare equal).
func roundTrip(t *testing.T, data []byte, fresh func() any) {
	v := fresh()
	if Decode(data, v) != nil {
		return
	}
	enc, err := Encode(v)
	if err != nil {
		t.Fatalf("%T decoded from %x does not encode: %v", v, data, err)
	}
	w := fresh()
	if err := Decode(enc, w); err != nil {
		t.Fatalf("%T: our encoding %x of %+v does not decode: %v", v, enc, v, err)
	}
	again, _ := Encode(w)
	if !bytes.Equal(enc, again) {
		t.Fatalf("%T: %+v re-encodes as %x, then %x", v, v, enc, again)
	}
}
