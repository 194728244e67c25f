package passivation

import (
	"fmt"
	"slices"
	"testing"
)

// sim drives a policy as the region does, one message at a time, and
// passivates at once what it evicts beyond the limit.
type sim struct {
	p       Policy[int]
	limit   int
	active  map[int]*Entry[int]
	evicted []int // ids in the order they were passivated
}

func newSim(t *testing.T, name string, limit int) *sim {
	t.Helper()
	p, err := New[int](name, limit)
	if err != nil {
		t.Fatal(err)
	}
	return &sim{p: p, limit: limit, active: map[int]*Entry[int]{}}
}

// access sends a message to id and reports whether it was active.
func (s *sim) access(id int) bool {
	e, hit := s.active[id]
	if !hit {
		e = &Entry[int]{Hash: uint32(id) * 2654435761, Value: id}
		s.active[id] = e
	}
	s.p.Touch(e)
	if over := s.p.Len() - s.limit; over > 0 {
		for _, v := range s.p.Evict(over, nil) {
			delete(s.active, v.Value)
			s.evicted = append(s.evicted, v.Value)
		}
	}
	return hit
}

func (s *sim) has(id int) bool { _, ok := s.active[id]; return ok }

func TestNew(t *testing.T) {
	for _, name := range append(Names(), "") {
		if _, err := New[int](name, 10); err != nil {
			t.Errorf("New(%q): %v", name, err)
		}
	}
	if _, err := New[int]("lfu", 10); err == nil {
		t.Error("New accepted an unknown policy")
	}
	if _, err := New[int](LRU, 0); err == nil {
		t.Error("New accepted a limit of 0")
	}
}

// TestLRUOrder: the least recently used go first; a touch moves an entry
// to the newest end.
func TestLRUOrder(t *testing.T) {
	s := newSim(t, LRU, 3)
	for _, id := range []int{1, 2, 3, 1, 4, 5} {
		s.access(id)
	}
	if want := []int{2, 3}; !slices.Equal(s.evicted, want) {
		t.Fatalf("evicted %v, want %v", s.evicted, want)
	}
}

// TestFrequentSurvivesScan: an entity used often stays active through a
// scan of ids seen once under W-TinyLFU; under LRU the scan passivates
// it.
func TestFrequentSurvivesScan(t *testing.T) {
	for _, tc := range []struct {
		name    string
		survive bool
	}{{WTinyLFU, true}, {LRU, false}} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSim(t, tc.name, 100)
			for range 8 {
				for id := range 100 {
					s.access(id)
				}
			}
			// 10 x the limit: the sketch halves its counters twice.
			for id := 1000; id < 2000; id++ {
				s.access(id)
			}
			if got := s.has(7); got != tc.survive {
				t.Fatalf("entity 7 active after the scan: %v, want %v", got, tc.survive)
			}
			if tc.survive {
				kept := 0
				for id := range 100 {
					if s.has(id) {
						kept++
					}
				}
				// The window (1 entity) and the probation share turn over;
				// the protected 80 % hold.
				if kept < 79 {
					t.Fatalf("%d of the 100 frequent entities kept through the scan", kept)
				}
			}
		})
	}
}

// TestSegmentOrder: within each segment of W-TinyLFU the least recently
// used goes first; a probation entry used again is promoted, and
// protected's oldest beyond its share is demoted to probation's newest.
func TestSegmentOrder(t *testing.T) {
	p := newWTinyLFU[int](10) // window 1, main 9, protected 7
	entries := map[int]*Entry[int]{}
	touch := func(ids ...int) {
		for _, id := range ids {
			e := entries[id]
			if e == nil {
				e = &Entry[int]{Hash: uint32(id), Value: id}
				entries[id] = e
			}
			p.Touch(e)
		}
	}
	ids := func(l *list[int]) []int {
		var out []int
		for e := l.root.next; e != &l.root; e = e.next {
			out = append(out, e.Value)
		}
		return out
	}
	touch(1, 2, 3, 4, 5, 6, 7, 8, 9, 10) // 10 in the window, 1..9 in probation
	if got, want := ids(&p.window), []int{10}; !slices.Equal(got, want) {
		t.Fatalf("window %v, want %v", got, want)
	}
	if got, want := ids(&p.probation), []int{1, 2, 3, 4, 5, 6, 7, 8, 9}; !slices.Equal(got, want) {
		t.Fatalf("probation %v, want %v", got, want)
	}
	touch(3, 1, 2, 4, 5, 6, 7, 8) // promoted in this order; 3 is protected's oldest
	if got, want := ids(&p.protected), []int{1, 2, 4, 5, 6, 7, 8}; !slices.Equal(got, want) {
		t.Fatalf("protected %v, want %v", got, want)
	}
	if got, want := ids(&p.probation), []int{9, 3}; !slices.Equal(got, want) {
		t.Fatalf("probation %v, want %v (3 demoted as its newest)", got, want)
	}
	touch(2) // protected's newest now
	if got, want := ids(&p.protected), []int{1, 4, 5, 6, 7, 8, 2}; !slices.Equal(got, want) {
		t.Fatalf("protected %v, want %v", got, want)
	}
	// A newcomer seen once against probation's oldest (9, seen once): the
	// tie passivates the newcomer (10 left the window for 11).
	touch(11)
	if got := p.Evict(1, nil); len(got) != 1 || got[0].Value != 10 {
		t.Fatalf("evicted %v, want the candidate 10", values(got))
	}
	// A candidate counted more often than probation's oldest (9, seen
	// once) displaces it: 11, touched twice more in the window, leaves
	// it for 12.
	touch(11, 11, 12)
	if got := p.Evict(1, nil); len(got) != 1 || got[0].Value != 9 {
		t.Fatalf("evicted %v, want probation's oldest 9, displaced by 11", values(got))
	}
	if got, want := ids(&p.probation), []int{3, 11}; !slices.Equal(got, want) {
		t.Fatalf("probation %v, want %v (11 admitted as its newest)", got, want)
	}
	if got, want := ids(&p.window), []int{12}; !slices.Equal(got, want) {
		t.Fatalf("window %v, want %v", got, want)
	}
	if n := p.Len(); n != 10 {
		t.Fatalf("Len %d, want 10", n)
	}
}

func values(es []*Entry[int]) []int {
	var out []int
	for _, e := range es {
		out = append(out, e.Value)
	}
	return out
}

// TestRemoveAndReadd: a removed or evicted entry is detached; touching it
// again adds it as new; removing a detached one does nothing.
func TestRemoveAndReadd(t *testing.T) {
	for _, name := range Names() {
		t.Run(name, func(t *testing.T) {
			p, _ := New[int](name, 4)
			es := make([]*Entry[int], 6)
			for i := range es {
				es[i] = &Entry[int]{Hash: uint32(i), Value: i}
				p.Touch(es[i])
			}
			p.Remove(es[0])
			p.Remove(es[0])
			if es[0].Attached() || p.Len() != 5 {
				t.Fatalf("after Remove: attached %v, Len %d", es[0].Attached(), p.Len())
			}
			gone := p.Evict(10, nil)
			if len(gone) != 5 || p.Len() != 0 {
				t.Fatalf("Evict(10) gave %d, Len %d", len(gone), p.Len())
			}
			for _, e := range gone {
				if e.Attached() {
					t.Fatalf("evicted %d still attached", e.Value)
				}
			}
			p.Remove(gone[0])
			p.Touch(gone[0])
			if p.Len() != 1 || !gone[0].Attached() {
				t.Fatalf("touched again: Len %d", p.Len())
			}
			if got := p.Evict(3, nil); len(got) != 1 {
				t.Fatalf("Evict(3) of one gave %d", len(got))
			}
		})
	}
}

// TestSketchAging: counters saturate at 15, and every 10 x limit
// increments halve them all, so that a formerly popular id loses to
// one popular now.
func TestSketchAging(t *testing.T) {
	var s sketch
	s.init(16) // 64 counters a row; resets every 160 increments
	for range 20 {
		s.increment(1)
	}
	if got := s.estimate(1); got != 15 {
		t.Fatalf("estimate after 20 increments %d, want 15 (saturated)", got)
	}
	if got := s.estimate(2); got != 0 {
		t.Fatalf("estimate of an id never seen %d", got)
	}
	// 140 more (160 in all) reset: 15 -> 7, and the samples to 80.
	for range 140 {
		s.increment(3)
	}
	if got := s.estimate(1); got != 7 {
		t.Fatalf("estimate after the reset %d, want 7", got)
	}
	if s.samples != 80 {
		t.Fatalf("samples after the reset %d, want 80", s.samples)
	}
	for range 80 { // another reset
		s.increment(4)
	}
	if got := s.estimate(1); got != 3 {
		t.Fatalf("estimate after the second reset %d, want 3", got)
	}
	for range 5 {
		s.increment(2)
	}
	if s.estimate(2) <= s.estimate(1) {
		t.Fatalf("popular now %d, formerly popular %d", s.estimate(2), s.estimate(1))
	}
}

// TestDeterministic: the same accesses give the same passivations.
func TestDeterministic(t *testing.T) {
	run := func() []int {
		s := newSim(t, WTinyLFU, 50)
		x := uint32(1)
		for range 20_000 {
			x ^= x << 13
			x ^= x >> 17
			x ^= x << 5
			s.access(int(x % 400))
		}
		return s.evicted
	}
	a, b := run(), run()
	if !slices.Equal(a, b) || len(a) == 0 {
		t.Fatalf("two runs passivated differently (%d, %d)", len(a), len(b))
	}
}

func ExampleNew() {
	p, _ := New[string](LRU, 2)
	a, b, c := &Entry[string]{Hash: 1, Value: "a"}, &Entry[string]{Hash: 2, Value: "b"}, &Entry[string]{Hash: 3, Value: "c"}
	p.Touch(a)
	p.Touch(b)
	p.Touch(a)
	p.Touch(c)
	for _, e := range p.Evict(p.Len()-2, nil) {
		fmt.Println("passivate", e.Value)
	}
	// Output: passivate b
}

func BenchmarkTouch(b *testing.B) {
	for _, name := range Names() {
		b.Run(name, func(b *testing.B) {
			p, _ := New[int](name, 10_000)
			es := make([]*Entry[int], 20_000)
			for i := range es {
				es[i] = &Entry[int]{Hash: uint32(i) * 2654435761, Value: i}
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				p.Touch(es[i%len(es)])
				if p.Len() > 10_000 {
					p.Evict(p.Len()-10_000, nil)
				}
				i += 7
			}
		})
	}
}
