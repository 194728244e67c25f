package strategies

import (
	"errors"
	"testing"
)

func TestParseCanonical(t *testing.T) {
	for spec, want := range map[string]string{
		"least-shard":                     DefaultSpec,
		" least-shard:absolute=65536 ":    DefaultSpec,
		"least-shard:relative=0.1":        "least-shard:absolute=65536,relative=0.1",
		"least-shard:absolute=20":         "least-shard:absolute=20,relative=1",
		"legacy-least-shard:threshold=2":  "legacy-least-shard:threshold=2,max-simultaneous=3",
		"consistent-hashing:limit=10":     "consistent-hashing:virtual-nodes=100,limit=10",
		"load-aware:entities-weight=0.01": "load-aware:entities-weight=0.01,hysteresis=0.2,max-moves=256",
	} {
		s, got, err := Parse(spec)
		if err != nil || s == nil || got != want {
			t.Errorf("Parse(%q) = %q, %v; want %q", spec, got, err, want)
		}
		// The canonical spec parses to itself.
		if _, again, err := Parse(got); err != nil || again != got {
			t.Errorf("Parse(%q) = %q, %v: not canonical", got, again, err)
		}
	}
}

func TestParseErrors(t *testing.T) {
	for _, spec := range []string{"", "random", "least-shard:", "least-shard:absolute", "least-shard:absolute=x",
		"least-shard:absolute=1.5", "least-shard:absolute=-1", "least-shard:relative=NaN", "least-shard:bogus=1",
		"consistent-hashing:virtual-nodes=1e40"} {
		if _, _, err := Parse(spec); !errors.Is(err, ErrBadSpec) {
			t.Errorf("Parse(%q): err %v, want ErrBadSpec", spec, err)
		}
	}
}
