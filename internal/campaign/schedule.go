package campaign

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// Kind is a kind of fault on the menu.
type Kind string

// The menu. A fault on a region names it (Fault.Region); on the NATS
// cluster, a server (Fault.Server) and for a split its peer (Fault.Peer).
const (
	// KillRegion: kill -9 of a shardd; healed by starting it again.
	KillRegion Kind = "kill-region"
	// TermRegion: SIGTERM of a shardd (a graceful leave); healed by
	// starting it again once it exited.
	TermRegion Kind = "term-region"
	// StopRegion: SIGSTOP of a shardd for 1-12 s; healed by SIGCONT.
	StopRegion Kind = "stop-region"
	// PartitionRegion: a black hole on a shardd's link to NATS (its
	// proxies stop forwarding bytes both ways, connections stay open);
	// healed by forwarding again.
	PartitionRegion Kind = "partition-region"
	// KillCoordinator: kill -9 of the shardd that holds the coordinator
	// lease when the fault starts (which one is known only then); healed by
	// starting it again.
	KillCoordinator Kind = "kill-coordinator"
	// KillServer: kill -9 of a nats-server; healed by starting it again on
	// its store.
	KillServer Kind = "kill-server"
	// IsolateServer: a nats-server's routes to both others black-holed
	// (it is in the minority); healed by forwarding again.
	IsolateServer Kind = "isolate-server"
	// SplitServers: the routes between two nats-servers black-holed, each
	// still routed to the third; healed by forwarding again.
	SplitServers Kind = "split-servers"
	// MoveShard: shardctl move of a shard to a region; nothing to heal.
	MoveShard Kind = "move"
	// DrainRegion: shardctl drain of a region; healed by shardctl undrain.
	DrainRegion Kind = "drain"
	// FillStore: the servers' JetStream stores filled by another stream
	// (R3, no byte limit) until they refuse it; healed by deleting it.
	// natshard's own streams have their limits reserved in the store.
	FillStore Kind = "fill-store"
)

// Kinds is the whole menu, in a fixed order (the schedule draws from it by
// index).
var Kinds = []Kind{
	KillRegion, TermRegion, StopRegion, PartitionRegion, KillCoordinator,
	KillServer, IsolateServer, SplitServers, MoveShard, DrainRegion, FillStore,
}

// onRegion reports whether k bears on one named region.
func (k Kind) onRegion() bool {
	switch k {
	case KillRegion, TermRegion, StopRegion, PartitionRegion, DrainRegion:
		return true
	}
	return false
}

// onNATS reports whether k bears on the NATS cluster.
func (k Kind) onNATS() bool {
	return k == KillServer || k == IsolateServer || k == SplitServers || k == FillStore
}

// Fault is one scheduled fault. Times are offsets from the start of the
// load.
type Fault struct {
	ID     int // 1, 2, ... in order of At
	Kind   Kind
	At     time.Duration // when it starts
	Heal   time.Duration // when it is healed; At for a move
	Region int           // the region (or a move's destination), -1 if none
	Server int           // the server, -1 if none
	Peer   int           // a split's other server, -1 if none
	Shard  int           // a move's shard, -1 if none
}

func (f Fault) String() string {
	s := fmt.Sprintf("#%d %s", f.ID, f.Kind)
	switch {
	case f.Kind == MoveShard:
		s += fmt.Sprintf(" shard %d to region %d", f.Shard, f.Region)
	case f.Region >= 0:
		s += fmt.Sprintf(" region %d", f.Region)
	case f.Peer >= 0:
		s += fmt.Sprintf(" servers %d|%d", f.Server, f.Peer)
	case f.Server >= 0:
		s += fmt.Sprintf(" server %d", f.Server)
	}
	s += fmt.Sprintf(" at %s", f.At)
	if f.Heal != f.At {
		s += fmt.Sprintf(", healed at %s", f.Heal)
	}
	return s
}

// Config bounds a schedule.
type Config struct {
	// Duration of the load: faults start within [Start, Duration-1s) and
	// are healed by Duration.
	Duration time.Duration
	// Start: the first fault's earliest offset (the load runs unfaulted
	// before it); 0 means 3 s.
	Start   time.Duration
	Regions int // regions, numbered 0..Regions-1
	Servers int // NATS servers, numbered 0..Servers-1
	Shards  int // shards of the type, for moves
	// Kinds is the menu to draw from; nil means Kinds.
	Kinds []Kind
}

// The schedule's bounds (issue 30).
const (
	minGap, maxGap   = 3 * time.Second, 8 * time.Second
	minHeal, maxHeal = 1 * time.Second, 10 * time.Second
	maxStop          = 12 * time.Second
	maxAtOnce        = 2
)

// Schedule returns the faults of the run with seed: one every 3-8 s (or,
// when two are in force, 1 s after the first of them heals), at most two
// in force at once, each healed after 1-10 s (a SIGSTOP 1-12 s);
// at most one fault at a time on each region and on the NATS cluster (so
// that a majority of servers always routes to each other: the cluster
// keeps its quorum), at most one coordinator kill at a time. It is a pure
// function of seed and cfg.
func Schedule(seed uint64, cfg Config) []Fault {
	menu := cfg.Kinds
	if menu == nil {
		menu = Kinds
	}
	start := cfg.Start
	if start == 0 {
		start = 3 * time.Second
	}
	rng := rand.New(rand.NewPCG(seed, 0x6e61747368617264)) // "natshard"
	between := func(lo, hi time.Duration) time.Duration {
		ms := int64((hi - lo) / time.Millisecond)
		return lo + time.Duration(rng.Int64N(ms+1))*time.Millisecond
	}
	var faults []Fault
	end := cfg.Duration - time.Second
	for t := start; t < end; {
		var active []Fault
		busyRegion := map[int]bool{}
		busyNATS, busyCoordinator := false, false
		for _, f := range faults {
			if f.At <= t && t < f.Heal {
				active = append(active, f)
			}
			// A target is busy until a second after its heal, so that a
			// fault on it never races with the heal of the one before.
			if f.At <= t && t < f.Heal+time.Second {
				if f.Kind.onRegion() {
					busyRegion[f.Region] = true
				}
				busyNATS = busyNATS || f.Kind.onNATS()
				busyCoordinator = busyCoordinator || f.Kind == KillCoordinator
			}
		}
		if len(active) >= maxAtOnce {
			next := active[0].Heal
			for _, f := range active[1:] {
				next = min(next, f.Heal)
			}
			// The next fault comes a second after a heal: not at its
			// instant, where the two would race on one target.
			t = next + time.Second
			continue
		}
		var free []int
		for r := range cfg.Regions {
			if !busyRegion[r] {
				free = append(free, r)
			}
		}
		var kinds []Kind
		for _, k := range menu {
			switch {
			case k.onRegion() && len(free) == 0,
				k.onNATS() && (busyNATS || cfg.Servers < 3),
				k == KillCoordinator && busyCoordinator,
				k == MoveShard && (cfg.Shards == 0 || cfg.Regions == 0):
				continue
			}
			kinds = append(kinds, k)
		}
		if len(kinds) == 0 {
			t += minGap
			continue
		}
		f := Fault{ID: len(faults) + 1, Kind: kinds[rng.IntN(len(kinds))], At: t, Region: -1, Server: -1, Peer: -1, Shard: -1}
		switch {
		case f.Kind.onRegion():
			f.Region = free[rng.IntN(len(free))]
		case f.Kind == KillServer || f.Kind == IsolateServer:
			f.Server = rng.IntN(cfg.Servers)
		case f.Kind == SplitServers:
			f.Server = rng.IntN(cfg.Servers)
			f.Peer = (f.Server + 1 + rng.IntN(cfg.Servers-1)) % cfg.Servers
		case f.Kind == MoveShard:
			f.Shard = rng.IntN(cfg.Shards)
			f.Region = rng.IntN(cfg.Regions)
		}
		switch f.Kind {
		case MoveShard:
			f.Heal = t
		case StopRegion:
			f.Heal = min(t+between(minHeal, maxStop), cfg.Duration)
		default:
			f.Heal = min(t+between(minHeal, maxHeal), cfg.Duration)
		}
		faults = append(faults, f)
		t += between(minGap, maxGap)
	}
	return faults
}
