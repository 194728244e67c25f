package protocol

import (
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
	for _, bad := range []string{"", ".a", "a.", "a..b", "a b", "a\tb", "a*", ">", "a\x00"} {
		if err := ValidateEntityID(bad); !errors.Is(err, ErrInvalidEntityID) {
			t.Errorf("%q: err %v, want ErrInvalidEntityID", bad, err)
		}
	}
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
}

// FuzzParseEntity: parsing never panics, and whatever parses round-trips.
func FuzzParseEntity(f *testing.F) {
	s := MustSubjects("", "", "kv")
	for _, seed := range []string{"shard.kv.3.42", "shard.kv.89.user.7", "shard.kv.", "shard.kv.1..", "shard.kv.999999999.x", "x"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, subject string) {
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

// FuzzDecodeCommand: decoding garbage never panics; what validates has a
// known kind and in-range shards.
func FuzzDecodeCommand(f *testing.F) {
	good, _ := Encode(Command{Kind: CmdBind, Epoch: 3, Incarnation: "x", Shards: []int{1, 2}})
	f.Add(good)
	f.Add([]byte{0xc1})
	f.Add([]byte("garbage"))
	f.Add([]byte{0x81, 0xa1, 's', 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x81, 0xa1, 'i', 0xdb, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		var c Command
		if Decode(data, &c) != nil || c.Validate(128) != nil {
			return
		}
		for _, s := range c.Shards {
			if s < 0 || s >= 128 {
				t.Fatalf("validated shard %d", s)
			}
		}
		var r Reply
		_ = Decode(data, &r)
		var rec ShardRecord
		_ = Decode(data, &rec)
	})
}
