package campaign

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// Outcome is what the load generator learned of one send.
type Outcome int

const (
	// Acked: the type's stream acknowledged the publish (durable), or the
	// entity answered the request (core). It must be applied.
	Acked Outcome = iota
	// Sent: a core publish went out on the connection; nobody acknowledges
	// it. Core delivery may lose it in a crash window.
	Sent
	// Unknown: no answer (a timeout, a lost connection): it may or may not
	// be applied, at most once.
	Unknown
	// Refused: no responders, or an answer saying no entity handled it
	// (Natshard-Refused): it must not be applied.
	Refused
)

func (o Outcome) String() string {
	switch o {
	case Acked:
		return "acked"
	case Sent:
		return "sent"
	case Unknown:
		return "unknown"
	case Refused:
		return "refused"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// Send is one value sent to an entity, with its final outcome (after the
// retries of a keyed value, which carry the same Nats-Msg-Id).
type Send struct {
	Value   int
	At      time.Duration // when its first try began, from the start of the load
	Outcome Outcome
	Why     string // what the outcome rests on, for the report (a refusal's reason)
}

// Entity is what was sent to one entity, in order (values 1, 2, 3...), and
// the history read back after the run (its kv array).
type Entity struct {
	ID      string
	Keyed   bool // every send carried a Nats-Msg-Id
	Sends   []Send
	History []int
}

// Mode is a delivery mode.
type Mode string

const (
	Core    Mode = "core"
	Durable Mode = "durable"
)

// ViolationKind is a way a history broke its promise.
type ViolationKind string

const (
	// Lost: acknowledged (or, in core delivery, sent) and absent.
	Lost ViolationKind = "lost"
	// Twice: applied more than once.
	Twice ViolationKind = "applied-twice"
	// OutOfOrder: first applied after a later value of the same entity.
	OutOfOrder ViolationKind = "out-of-order"
	// Phantom: applied though never sent, or refused (PROTOCOL.md: nothing
	// was done with a refused message, so sending it again is safe).
	Phantom ViolationKind = "phantom"
)

// Violation is one value that broke a promise.
type Violation struct {
	Kind    ViolationKind
	Entity  string
	Keyed   bool
	Value   int
	Outcome Outcome       // of its send (Lost: Acked or Sent)
	Why     string        // of its send
	At      time.Duration // when it was sent; -1 if never
	// InForce: the faults in force at At (started by At+Slack, healed at
	// or after At-Slack); Recent: those healed within Settle before it;
	// Later: those that started within Settle after it (a value held in
	// a buffer or a mailbox meets faults after it was sent).
	InForce, Recent, Later []int
	History                string // the entity's history around the value
}

// Counts are one class of entities' (keyed or keyless) figures.
type Counts struct {
	Entities int
	Sent     map[Outcome]int
	// UnknownApplied: values of unknown outcome found applied (once).
	UnknownApplied int
	Violations     map[ViolationKind]int
	// LostSent: of the Lost, those only sent (core publishes), not
	// acknowledged; LostUnattributed: Lost with no fault in force or
	// recent.
	LostSent, LostUnattributed int
}

// Report is the checker's verdict on a run.
type Report struct {
	Mode           Mode
	Keyed, Keyless Counts
	Violations     []Violation
	// ByFault: violations attributed (in force) to each fault id, per kind.
	ByFault map[int]map[ViolationKind]int
}

// Attribution bounds: a value sent within Slack of a fault's start or heal
// is in force with it; Settle after a heal the fault is recent.
const (
	Slack  = 500 * time.Millisecond
	Settle = 10 * time.Second
)

// Check compares what was sent with what each entity holds.
func Check(mode Mode, entities []Entity, faults []Fault) Report {
	rep := Report{Mode: mode, ByFault: map[int]map[ViolationKind]int{}}
	for _, c := range []*Counts{&rep.Keyed, &rep.Keyless} {
		c.Sent = map[Outcome]int{}
		c.Violations = map[ViolationKind]int{}
	}
	for _, e := range entities {
		c := &rep.Keyless
		if e.Keyed {
			c = &rep.Keyed
		}
		c.Entities++
		sends := map[int]Send{}
		for _, s := range e.Sends {
			sends[s.Value] = s
			c.Sent[s.Outcome]++
		}
		add := func(k ViolationKind, v int, at int) {
			s, ok := sends[v]
			viol := Violation{Kind: k, Entity: e.ID, Keyed: e.Keyed, Value: v, Outcome: s.Outcome, Why: s.Why, At: -1, History: excerpt(e.History, at)}
			if ok {
				viol.At = s.At
				viol.InForce, viol.Recent, viol.Later = attribute(faults, s.At)
			}
			c.Violations[k]++
			if k == Lost && s.Outcome == Sent {
				c.LostSent++
			}
			if k == Lost && len(viol.InForce) == 0 && len(viol.Recent) == 0 {
				c.LostUnattributed++
			}
			for _, id := range viol.InForce {
				if rep.ByFault[id] == nil {
					rep.ByFault[id] = map[ViolationKind]int{}
				}
				rep.ByFault[id][k]++
			}
			rep.Violations = append(rep.Violations, viol)
		}
		seen := map[int]int{} // value -> times applied
		highest := 0          // the highest value applied so far
		for i, v := range e.History {
			seen[v]++
			s, sent := sends[v]
			switch {
			case seen[v] == 2:
				add(Twice, v, i)
			case seen[v] > 2:
			case !sent || s.Outcome == Refused:
				add(Phantom, v, i)
			case v < highest:
				add(OutOfOrder, v, i)
			}
			highest = max(highest, v)
		}
		for _, s := range e.Sends {
			switch {
			case seen[s.Value] == 0 && (s.Outcome == Acked || s.Outcome == Sent):
				add(Lost, s.Value, -1)
			case seen[s.Value] > 0 && s.Outcome == Unknown:
				c.UnknownApplied++
			}
		}
	}
	return rep
}

// attribute returns the faults in force at t, those healed within Settle
// before it and those started within Settle after it.
func attribute(faults []Fault, t time.Duration) (inForce, recent, later []int) {
	for _, f := range faults {
		heal := max(f.Heal, f.At+Slack) // a move is in force for a moment
		switch {
		case f.At-Slack <= t && t <= heal+Slack:
			inForce = append(inForce, f.ID)
		case heal < t && t <= heal+Settle:
			recent = append(recent, f.ID)
		case t < f.At && f.At <= t+Settle:
			later = append(later, f.ID)
		}
	}
	return inForce, recent, later
}

// excerpt is the history around index i (the whole tail when i < 0).
func excerpt(h []int, i int) string {
	lo, hi := max(i-5, 0), min(i+6, len(h))
	if i < 0 {
		lo, hi = max(len(h)-8, 0), len(h)
	}
	var b strings.Builder
	if lo > 0 {
		b.WriteString("... ")
	}
	for j := lo; j < hi; j++ {
		if j > lo {
			b.WriteByte(' ')
		}
		if j == i {
			fmt.Fprintf(&b, "[%d]", h[j])
		} else {
			fmt.Fprint(&b, h[j])
		}
	}
	if hi < len(h) {
		b.WriteString(" ...")
	}
	return b.String()
}

// Failures are the violations docs/FAULTS.md's "Guarantees" forbid in the
// report's mode: in durable delivery every violation; in core delivery keyed
// values applied twice or out of order, and phantoms. (Core delivery may lose
// what it was sent in a crash window, and apply keyless values twice in a
// move's overlap: reported, not failures.)
func (r Report) Failures() map[ViolationKind]int {
	out := map[ViolationKind]int{}
	for _, v := range r.Violations {
		if r.Mode == Durable || v.Kind == Phantom || (v.Keyed && (v.Kind == Twice || v.Kind == OutOfOrder)) {
			out[v.Kind]++
		}
	}
	return out
}

// Lines is the report as lines to log, each starting "campaign:", with up
// to examples violations of each kind and class.
func (r Report) Lines(examples int) []string {
	var lines []string
	for _, class := range []struct {
		name string
		c    Counts
	}{{"keyed", r.Keyed}, {"keyless", r.Keyless}} {
		c := class.c
		lines = append(lines, fmt.Sprintf("campaign: %s %s: %d entities; values acked %d, sent %d, unknown %d (%d of them applied), refused %d; lost %d (%d only sent, %d with no fault in force or recent), applied twice %d, out of order %d, phantom %d",
			r.Mode, class.name, c.Entities, c.Sent[Acked], c.Sent[Sent], c.Sent[Unknown], c.UnknownApplied, c.Sent[Refused],
			c.Violations[Lost], c.LostSent, c.LostUnattributed, c.Violations[Twice], c.Violations[OutOfOrder], c.Violations[Phantom]))
	}
	shown := map[string]int{}
	for _, v := range r.Violations {
		key := fmt.Sprint(v.Kind, v.Keyed)
		if shown[key] >= examples {
			continue
		}
		shown[key]++
		class := "keyless"
		if v.Keyed {
			class = "keyed"
		}
		sent := "never sent"
		if v.At >= 0 {
			sent = fmt.Sprintf("%s, sent at %s", v.Outcome, v.At)
			if v.Why != "" {
				sent = fmt.Sprintf("%s (%s), sent at %s", v.Outcome, v.Why, v.At)
			}
		}
		lines = append(lines, fmt.Sprintf("campaign: %s %s %s: entity %s value %d (%s): %s; faults in force %v, healed within %s before %v, started within %s after %v",
			r.Mode, class, v.Kind, v.Entity, v.Value, sent, v.History, v.InForce, Settle, v.Recent, Settle, v.Later))
	}
	ids := make([]int, 0, len(r.ByFault))
	for id := range r.ByFault {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	for _, id := range ids {
		kinds := make([]string, 0, len(r.ByFault[id]))
		for k, n := range r.ByFault[id] {
			kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
		}
		slices.Sort(kinds)
		lines = append(lines, fmt.Sprintf("campaign: %s violations in force with fault #%d: %s", r.Mode, id, strings.Join(kinds, ", ")))
	}
	return lines
}
