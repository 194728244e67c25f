// Package passivation chooses which active entities a region passivates
// when it holds more than its active-entity limit (Type.MaxActive).
//
// A Policy orders the entities it is told about; it does no I/O, reads no
// clock and is deterministic: the same calls give the same choices. It is
// not safe for concurrent use (the region guards it with a mutex).
//
// The caller owns the entries: it allocates one Entry per active entity,
// with the entity's Hash and a Value of its choice (the region keeps the
// entity's id and shard there), calls Touch on every message to the entity,
// Remove when the entity stops for another reason, and Evict when it holds
// more than the limit. Evict detaches the entries it returns; the caller
// passivates those entities, or Touches an entry again to keep its entity
// (a busy one, say). An entry belongs to one Policy at a time.
//
// Two policies exist:
//
//   - WTinyLFU (the default, as in Akka Cluster Sharding's default
//     strategy): an admission window (LRU, 1 % of the limit) in front of a
//     segmented LRU main area (80 % protected, the rest probation). An
//     entity that leaves the window enters the main area when there is
//     room, or when a count-min frequency sketch (4 rows of 4-bit
//     counters, 4 x the limit wide, halved every 10 x limit messages) estimates it is used
//     more often than the main area's least recently used probation
//     entity, which it then displaces; otherwise it is the one passivated.
//     Entities used once (a scan) pass through the window without
//     displacing the frequent ones.
//   - LRU: the least recently used entities go first.
package passivation

import (
	"fmt"
	"math/bits"
	"strings"
)

// Names of the policies, as New takes them.
const (
	LRU      = "lru"
	WTinyLFU = "w-tinylfu"
	// Default is the policy of an empty name.
	Default = WTinyLFU
)

// Names lists the policies New accepts.
func Names() []string { return []string{WTinyLFU, LRU} }

// Check reports whether New accepts name ("" is Default).
func Check(name string) error {
	switch name {
	case "", WTinyLFU, LRU:
		return nil
	}
	return fmt.Errorf("unknown passivation policy %q (known: %s)", name, strings.Join(Names(), ", "))
}

// Policy orders active entities for passivation beyond a limit.
type Policy[T any] interface {
	// Touch records a message to e's entity. A detached entry (new, or
	// returned by Evict) is added as a newly activated entity.
	Touch(e *Entry[T])
	// Remove forgets e (its entity stopped for another reason). Removing
	// a detached entry does nothing.
	Remove(e *Entry[T])
	// Evict detaches up to n entries, the least valuable first, appends
	// them to out and returns it. It returns fewer when it holds fewer.
	Evict(n int, out []*Entry[T]) []*Entry[T]
	// Len is the number of entries held (attached).
	Len() int
}

// New returns the policy called name (Default when name is "") for a
// region that holds at most limit entities.
func New[T any](name string, limit int) (Policy[T], error) {
	if limit <= 0 {
		return nil, fmt.Errorf("passivation: limit %d is not positive", limit)
	}
	if err := Check(name); err != nil {
		return nil, err
	}
	if name == LRU {
		p := &lru[T]{}
		p.order.init()
		return p, nil
	}
	return newWTinyLFU[T](limit), nil
}

// Entry is one active entity in a Policy. Hash, the entity's hash (any
// well-mixed 32 bits of its id), must be set before the first Touch and
// not changed after. Its size is 24 bytes plus Value's: 48 with a string
// and an int.
type Entry[T any] struct {
	prev, next *Entry[T]
	Hash       uint32
	seg        segment
	Value      T
}

// Attached reports whether e is held by a policy (it was Touched and
// neither Removed nor Evicted since).
func (e *Entry[T]) Attached() bool { return e.seg != segNone }

// segment says which list of its policy holds an entry.
type segment uint8

const (
	segNone      segment = iota // detached
	segLRU                      // lru's only list
	segWindow                   // W-TinyLFU's admission window
	segCandidate                // left the window, not yet admitted to the main area
	segProbation                // main area, seen once since admitted
	segProtected                // main area, seen again
)

// list is an intrusive doubly linked list of entries, circular through
// root: root.next is the oldest (least recently used), root.prev the
// newest. It must not be copied after init.
type list[T any] struct {
	root Entry[T]
	n    int
}

func (l *list[T]) init() { l.root.next, l.root.prev = &l.root, &l.root }

// oldest returns the least recently used entry, nil when l is empty.
func (l *list[T]) oldest() *Entry[T] {
	if l.n == 0 {
		return nil
	}
	return l.root.next
}

// pushNewest appends the detached e as the most recently used, in seg.
func (l *list[T]) pushNewest(e *Entry[T], seg segment) {
	last := l.root.prev
	e.prev, e.next = last, &l.root
	last.next, l.root.prev = e, e
	e.seg = seg
	l.n++
}

// remove detaches e, which l holds.
func (l *list[T]) remove(e *Entry[T]) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	e.seg = segNone
	l.n--
}

// moveNewest makes e, which l holds, the most recently used.
func (l *list[T]) moveNewest(e *Entry[T]) {
	seg := e.seg
	l.remove(e)
	l.pushNewest(e, seg)
}

// lru is the least recently used policy.
type lru[T any] struct{ order list[T] }

func (p *lru[T]) Len() int { return p.order.n }

func (p *lru[T]) Touch(e *Entry[T]) {
	if e.seg == segNone {
		p.order.pushNewest(e, segLRU)
		return
	}
	p.order.moveNewest(e)
}

func (p *lru[T]) Remove(e *Entry[T]) {
	if e.seg == segLRU {
		p.order.remove(e)
	}
}

func (p *lru[T]) Evict(n int, out []*Entry[T]) []*Entry[T] {
	for ; n > 0 && p.order.n > 0; n-- {
		e := p.order.oldest()
		p.order.remove(e)
		out = append(out, e)
	}
	return out
}

// wTinyLFU is Window TinyLFU (Einziger, Friedman and Manes, "TinyLFU: A
// Highly Efficient Cache Admission Policy", 2017), the policy of Akka's
// default passivation strategy, without its adaptive window size.
//
// New entries enter the window; Touch spills the window's oldest beyond
// windowMax into candidates, which are admitted to probation for free
// while the main area (probation and protected) holds fewer than mainMax.
// Evict then judges the candidates, oldest first, against the main
// area's oldest probation entry (protected's when probation is empty):
// the one the sketch counts less often goes (the candidate on a tie). A
// Touch of a probation entry (or a candidate) promotes it to protected,
// whose oldest beyond protectedMax go back to probation as its newest.
type wTinyLFU[T any] struct {
	window, candidates, probation, protected list[T]

	windowMax, mainMax, protectedMax int
	sketch                           sketch
}

func newWTinyLFU[T any](limit int) *wTinyLFU[T] {
	w := max(1, limit/100)
	main := max(0, limit-w)
	p := &wTinyLFU[T]{windowMax: w, mainMax: main, protectedMax: main * 8 / 10}
	p.window.init()
	p.candidates.init()
	p.probation.init()
	p.protected.init()
	p.sketch.init(limit)
	return p
}

func (p *wTinyLFU[T]) Len() int {
	return p.window.n + p.candidates.n + p.probation.n + p.protected.n
}

func (p *wTinyLFU[T]) list(seg segment) *list[T] {
	switch seg {
	case segWindow:
		return &p.window
	case segCandidate:
		return &p.candidates
	case segProbation:
		return &p.probation
	case segProtected:
		return &p.protected
	}
	return nil
}

func (p *wTinyLFU[T]) Touch(e *Entry[T]) {
	p.sketch.increment(e.Hash)
	switch e.seg {
	case segWindow, segProtected:
		p.list(e.seg).moveNewest(e)
	case segCandidate, segProbation:
		p.list(e.seg).remove(e)
		p.protected.pushNewest(e, segProtected)
		for p.protected.n > p.protectedMax {
			d := p.protected.oldest()
			p.protected.remove(d)
			p.probation.pushNewest(d, segProbation)
		}
	case segNone:
		p.window.pushNewest(e, segWindow)
		for p.window.n > p.windowMax {
			c := p.window.oldest()
			p.window.remove(c)
			p.candidates.pushNewest(c, segCandidate)
		}
		p.admitFree()
	}
}

// admitFree moves candidates into probation while the main area has room.
func (p *wTinyLFU[T]) admitFree() {
	for p.candidates.n > 0 && p.probation.n+p.protected.n < p.mainMax {
		c := p.candidates.oldest()
		p.candidates.remove(c)
		p.probation.pushNewest(c, segProbation)
	}
}

func (p *wTinyLFU[T]) Remove(e *Entry[T]) {
	if l := p.list(e.seg); l != nil {
		l.remove(e)
		p.admitFree()
	}
}

func (p *wTinyLFU[T]) Evict(n int, out []*Entry[T]) []*Entry[T] {
	for ; n > 0; n-- {
		var gone *Entry[T]
		if c := p.candidates.oldest(); c != nil {
			victims := &p.probation
			if victims.n == 0 {
				victims = &p.protected
			}
			gone = c
			if v := victims.oldest(); v != nil && p.sketch.estimate(c.Hash) > p.sketch.estimate(v.Hash) {
				gone = v
				p.candidates.remove(c)
				p.probation.pushNewest(c, segProbation)
			}
		} else {
			// No candidate: the main area is within its share, yet the
			// caller holds too many (entities it keeps outside the
			// policy). The oldest of the main area go, then the window's.
			for _, l := range []*list[T]{&p.probation, &p.protected, &p.window} {
				if gone = l.oldest(); gone != nil {
					break
				}
			}
			if gone == nil {
				break
			}
		}
		p.list(gone.seg).remove(gone)
		out = append(out, gone)
	}
	return out
}

// sketch is a count-min sketch: depth rows of 4-bit counters, 16 to a
// word, width the power of two at least 4 x the limit (Akka's and
// Caffeine's proportion: narrower, the counters of a scan's ids collide
// with the frequent ones'). Every increment counts a
// sample; after resetEvery samples every counter is halved, so that old
// popularity fades (TinyLFU's reset).
type sketch struct {
	rows       [depth][]uint64
	mask       uint64 // width - 1
	samples    int
	resetEvery int
}

const depth = 4

// seeds give each row its own hash of an entry's Hash.
var seeds = [depth]uint64{0x9e3779b97f4a7c15, 0xc2b2ae3d27d4eb4f, 0x165667b19e3779f9, 0xd6e8feb86659fd93}

func (s *sketch) init(limit int) {
	width := uint64(1) << bits.Len(uint(max(4*limit, 16)-1))
	s.mask = width - 1
	for i := range s.rows {
		s.rows[i] = make([]uint64, width/16)
	}
	s.resetEvery = 10 * limit
}

// index returns the word and the bit shift of h's counter in row r.
func (s *sketch) index(h uint32, r int) (word uint64, shift uint) {
	x := (uint64(h) + seeds[r]) * 0xbf58476d1ce4e5b9
	x ^= x >> 31
	x *= 0x94d049bb133111eb
	x ^= x >> 29
	i := x & s.mask
	return i >> 4, uint(i&15) * 4
}

// increment adds one to h's counters (each saturates at 15).
func (s *sketch) increment(h uint32) {
	for r := range s.rows {
		w, sh := s.index(h, r)
		if (s.rows[r][w]>>sh)&15 < 15 {
			s.rows[r][w] += 1 << sh
		}
	}
	if s.samples++; s.samples >= s.resetEvery {
		s.halve()
	}
}

// halve halves every counter and the sample count.
func (s *sketch) halve() {
	for r := range s.rows {
		for i, w := range s.rows[r] {
			s.rows[r][i] = (w >> 1) & 0x7777777777777777
		}
	}
	s.samples /= 2
}

// estimate returns how often h was counted (at least), 0..15.
func (s *sketch) estimate(h uint32) uint8 {
	m := uint8(15)
	for r := range s.rows {
		w, sh := s.index(h, r)
		m = min(m, uint8((s.rows[r][w]>>sh)&15))
	}
	return m
}
