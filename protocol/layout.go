package protocol

import (
	"fmt"
	"slices"
	"strings"
)

// Layout is an entity type's shard counts through its splits (resharding,
// docs/PROTOCOL.md): the counts it had, oldest first, then the count it
// routes by now, last. Each count divides the next, so an entity of shard
// s under count N is, under N' = k x N, in one of s, s+N, ..., s+(k-1)N:
// the children of s. A type never split has one count. The zero Layout has
// none and is not valid; use NewLayout or TypeConfig.Layout. A Layout is a
// value: its methods never change it.
type Layout struct {
	counts []int
}

// NewLayout returns the layout of the counts, oldest first. Each must be in
// 1..MaxShards and divide the next, strictly smaller.
func NewLayout(counts ...int) (Layout, error) {
	if len(counts) == 0 {
		return Layout{}, fmt.Errorf("%w: a layout without shard count", ErrMalformed)
	}
	for i, n := range counts {
		if n < 1 || n > MaxShards {
			return Layout{}, fmt.Errorf("%w: shard count %d out of range 1..%d", ErrMalformed, n, MaxShards)
		}
		if i > 0 && (n <= counts[i-1] || n%counts[i-1] != 0) {
			return Layout{}, fmt.Errorf("%w: shard count %d after %d is not a larger multiple of it", ErrMalformed, n, counts[i-1])
		}
	}
	return Layout{counts: slices.Clone(counts)}, nil
}

// MustLayout is NewLayout for constant arguments known to be valid; it
// panics otherwise. For tests and defaults only.
func MustLayout(counts ...int) Layout {
	l, err := NewLayout(counts...)
	if err != nil {
		panic(err)
	}
	return l
}

// Shards is the count the layout routes by: its last.
func (l Layout) Shards() int {
	if len(l.counts) == 0 {
		return 0
	}
	return l.counts[len(l.counts)-1]
}

// Counts returns the counts, oldest first.
func (l Layout) Counts() []int { return slices.Clone(l.counts) }

// Split reports whether the type was ever split: it has old subjects.
func (l Layout) Split() bool { return len(l.counts) > 1 }

// Has reports whether n is one of the layout's counts.
func (l Layout) Has(n int) bool { return slices.Contains(l.counts, n) }

// To returns the layout after a split to n shards: n must be a larger
// multiple of Shards() and at most MaxShards. The error says why not, in
// words an operator can act on.
func (l Layout) To(n int) (Layout, error) {
	cur := l.Shards()
	switch {
	case n > MaxShards:
		return Layout{}, fmt.Errorf("%d shards: at most %d", n, MaxShards)
	case n < cur:
		return Layout{}, fmt.Errorf("%d shards is fewer than the type's %d: a type's shard count only grows (merging shards would move every one of them; make a new type instead)", n, cur)
	case n == cur:
		return Layout{}, fmt.Errorf("the type has %d shards already", cur)
	case n%cur != 0:
		return Layout{}, fmt.Errorf("%d shards is not a multiple of the type's %d: every shard splits into the same number of children (try %d or %d)", n, cur, cur*(n/cur), cur*(n/cur+1))
	}
	return Layout{counts: append(slices.Clone(l.counts), n)}, nil
}

// ShardOf is the shard of entity id under the layout's count.
func (l Layout) ShardOf(id string) int { return ShardOf(id, l.Shards()) }

// Tokens returns the shard numbers whose subjects shard listens on: its
// number under each earlier count (its ancestors), oldest first, then its
// own, without repeats. A shard of a type never split, or a shard that
// kept its number through every split, listens on its own subject only.
func (l Layout) Tokens(shard int) []int {
	out := make([]int, 0, len(l.counts))
	for _, n := range l.counts {
		if t := shard % n; len(out) == 0 || out[len(out)-1] != t {
			out = append(out, t)
		}
	}
	return out
}

// Children returns the shards that shard of count from becomes under the
// layout's count: shard, shard+from, ... (shard first). from must be one
// of the layout's counts.
func (l Layout) Children(shard, from int) []int {
	k := l.Shards() / from
	out := make([]int, k)
	for j := range k {
		out[j] = shard + j*from
	}
	return out
}

// Forward returns the shard to which the owner of shard token moves a
// message of entity id published on token's subject (durable delivery,
// docs/PROTOCOL.md, Resharding): the entity's shard under the first count
// that gives it another number than token, the next step down its line of
// shards, so that each step keeps the order in which the messages came.
// It returns token when the entity is token's under the layout's count
// (the message is token's own), and -1 when token is not the entity's
// shard under any count.
func (l Layout) Forward(token int, id string) int {
	own := false
	for _, n := range l.counts {
		switch s := ShardOf(id, n); {
		case s == token:
			own = true
		case own:
			return s
		}
	}
	if !own {
		return -1
	}
	return token
}

// String is the counts, "128>256>512".
func (l Layout) String() string {
	parts := make([]string, len(l.counts))
	for i, n := range l.counts {
		parts[i] = fmt.Sprint(n)
	}
	return strings.Join(parts, ">")
}

// ParseEntity splits a data subject of the type (s) into its shard token,
// the entity's shard under the layout's count, and the entity id. A token
// that is not the entity's shard under any of the layout's counts is
// ErrWrongShard; a token is never above the layout's count. For a layout
// of one count it is Subjects.ParseEntity, with token == shard.
func (l Layout) ParseEntity(s Subjects, subject string) (token, shard int, id string, err error) {
	n := l.Shards()
	rest, ok := strings.CutPrefix(subject, s.data)
	if !ok {
		return 0, 0, "", fmt.Errorf("%w: %q is not under %q", ErrInvalidSubject, subject, s.data)
	}
	tok, id, ok := strings.Cut(rest, ".")
	if !ok {
		return 0, 0, "", fmt.Errorf("%w: %q has no entity id", ErrInvalidSubject, subject)
	}
	token, err = parseShard(tok, n)
	if err != nil {
		return 0, 0, "", fmt.Errorf("%w: %q: %v", ErrInvalidSubject, subject, err)
	}
	h, valid := hashEntityID(id)
	if !valid {
		return 0, 0, "", ValidateEntityID(id)
	}
	shard = int(h % uint32(n))
	if shard == token {
		return token, shard, id, nil
	}
	for _, c := range l.counts[:len(l.counts)-1] {
		if int(h%uint32(c)) == token {
			return token, shard, id, nil
		}
	}
	return 0, 0, "", fmt.Errorf("%w: %q is in shard %d, not %d", ErrWrongShard, id, shard, token)
}
