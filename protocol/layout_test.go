package protocol

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

func TestLayoutTo(t *testing.T) {
	l := MustLayout(128)
	for _, tc := range []struct {
		n    int
		want string // "" when refused
	}{
		{256, "128>256"},
		{512, "128>512"},
		{128 * 3, "128>384"},
		{128, ""},
		{64, ""},
		{200, ""},
		{MaxShards * 2, ""},
	} {
		got, err := l.To(tc.n)
		if (err == nil) != (tc.want != "") || err == nil && got.String() != tc.want {
			t.Errorf("To(%d) = %v, %v; want %q", tc.n, got, err, tc.want)
		}
	}
	if _, err := NewLayout(128, 200); !errors.Is(err, ErrMalformed) {
		t.Errorf("a count that is not a multiple: %v", err)
	}
	if l.Counts()[0] != 128 || len(MustLayout(128, 256).Counts()) != 2 {
		t.Error("Counts")
	}
}

func TestLayoutTokens(t *testing.T) {
	l := MustLayout(128, 256, 512)
	for _, tc := range []struct {
		shard int
		want  []int
	}{
		{16, []int{16}},
		{144, []int{16, 144}},
		{272, []int{16, 272}},
		{400, []int{16, 144, 400}},
	} {
		if got := l.Tokens(tc.shard); !slices.Equal(got, tc.want) {
			t.Errorf("Tokens(%d) = %v, want %v", tc.shard, got, tc.want)
		}
	}
	if got := l.Children(16, 128); !slices.Equal(got, []int{16, 144, 272, 400}) {
		t.Errorf("Children(16, 128) = %v", got)
	}
}

// TestLayoutChildren: every entity of a parent is in one of its children,
// and a child's tokens name its ancestors: the property resharding rests
// on (fnv1a32(id) % kN % N == fnv1a32(id) % N).
func TestLayoutChildren(t *testing.T) {
	l := MustLayout(128, 256, 1024)
	for i := range 10_000 {
		id := fmt.Sprintf("e-%d", i)
		child := l.ShardOf(id)
		for _, n := range []int{128, 256} {
			if parent := ShardOf(id, n); !slices.Contains(l.Children(parent, n), child) {
				t.Fatalf("%s: shard %d of %d is not among the children %v of shard %d of %d", id, child, 1024, l.Children(parent, n), parent, n)
			}
			if !slices.Contains(l.Tokens(child), ShardOf(id, n)) {
				t.Fatalf("%s: shard %d does not listen on its ancestor %d", id, child, ShardOf(id, n))
			}
		}
	}
}

// TestLayoutForward: a message published under any count reaches its
// entity's shard step by step, each step one count further, and never
// goes back.
func TestLayoutForward(t *testing.T) {
	l := MustLayout(128, 256, 1024)
	for i := range 10_000 {
		id := fmt.Sprintf("e-%d", i)
		own := l.ShardOf(id)
		if got := l.Forward(own, id); got != own {
			t.Fatalf("%s: Forward(%d) of its own shard = %d", id, own, got)
		}
		for _, n := range l.Counts() {
			tok, steps := ShardOf(id, n), 0
			for next := l.Forward(tok, id); next != tok; next = l.Forward(tok, id) {
				if next < tok || !slices.Contains(l.Tokens(own), next) || steps > 2 {
					t.Fatalf("%s: from %d (of %d) to %d after %d steps; its shard is %d", id, ShardOf(id, n), n, next, steps, own)
				}
				tok, steps = next, steps+1
			}
			if tok != own {
				t.Fatalf("%s: from shard %d of %d ends at %d, not %d", id, ShardOf(id, n), n, tok, own)
			}
		}
		if got := l.Forward((own+1)%128, id); got != -1 {
			t.Fatalf("%s: Forward of a shard that is none of its = %d", id, got)
		}
	}
}

func TestLayoutParseEntity(t *testing.T) {
	s := MustSubjects("", "", "orders")
	one := MustLayout(128)
	two := MustLayout(128, 256)
	// order-42 is in shard 116 of 128; of 256 it is 116 or 244 (its
	// child), never 245.
	child := ShardOf("order-42", 256)
	for _, tc := range []struct {
		l            Layout
		subject      string
		token, shard int
		err          error
	}{
		{one, "shard.orders.116.order-42", 116, 116, nil},
		{one, "shard.orders.117.order-42", 0, 0, ErrWrongShard},
		{one, "shard.orders.200.order-42", 0, 0, ErrInvalidSubject},
		{two, "shard.orders.116.order-42", 116, child, nil},
		{two, fmt.Sprintf("shard.orders.%d.order-42", child), child, child, nil},
		{two, "shard.orders.245.order-42", 0, 0, ErrWrongShard},
		{two, "shard.orders.256.order-42", 0, 0, ErrInvalidSubject},
		{two, "shard.orders.1.*", 0, 0, ErrInvalidEntityID},
		{two, "shard.other.1.x", 0, 0, ErrInvalidSubject},
	} {
		token, shard, id, err := tc.l.ParseEntity(s, tc.subject)
		if !errors.Is(err, tc.err) {
			t.Errorf("%v %q: err %v, want %v", tc.l, tc.subject, err, tc.err)
			continue
		}
		if err == nil && (token != tc.token || shard != tc.shard || id != "order-42") {
			t.Errorf("%v %q: got %d %d %q, want %d %d", tc.l, tc.subject, token, shard, id, tc.token, tc.shard)
		}
	}
}

func TestTypeConfigLayout(t *testing.T) {
	l, err := TypeConfig{Shards: 256, History: []int{128}, To: 512}.Layout()
	if err != nil || l.String() != "128>256>512" {
		t.Fatalf("%v %v", l, err)
	}
	if _, err := (TypeConfig{Shards: 256, History: []int{100}}).Layout(); err == nil {
		t.Fatal("a stored history that is not a layout was taken")
	}
	c := TypeConfig{Shards: 256, History: []int{128}, To: 512}
	data, err := Encode(c)
	if err != nil {
		t.Fatal(err)
	}
	var got TypeConfig
	if err := Decode(data, &got); err != nil || got.To != 512 || !slices.Equal(got.History, []int{128}) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
}
