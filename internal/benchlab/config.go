package benchlab

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/protocol"
)

// ErrUsage marks an error of the configuration: a field (a flag of
// shardctl bench) the caller must change, or a --type that exists on the
// server given.
var ErrUsage = errors.New("usage")

// Config is what to measure: shardctl bench's flags, named after them.
type Config struct {
	NATS          string // "": an embedded server
	Type          string
	DataPrefix    string
	ControlPrefix string
	Timeout       time.Duration

	Regions  int
	Shards   int
	Kind     string
	Entities int
	Msgs     int // 0: DefaultMsgs of each delivery mode
	Size     int
	Pubs     int
	Window   int
	Rounds   int
	Requests int
	Callers  int    // concurrent callers of the client run (0: none)
	Delivery string // core, durable or both
	// BestConsumers: the pull consumers of raw JetStream in its best
	// shape (durable delivery; best.go).
	BestConsumers int
	// LoadLatency: measure the latency tables under load (loadlat.go).
	LoadLatency bool
	LowRate     float64
	LoadSeconds float64
	Servers     int // embedded servers (a cluster when more than one)
	Replicas    int // of the type's bucket and streams; 0: Servers, at most 3

	Handoff         bool
	HandoffEntities int
	Moves           int
	Rate            float64
	Failover        bool
	Kills           int

	Progress     bool
	CPUProfile   string
	SideProfiles string
	MemProfile   string
}

// Values of --delivery.
const (
	DeliveryCore    = "core"
	DeliveryDurable = "durable"
	DeliveryBoth    = "both"
)

// deliveries lists the delivery modes to measure, in the order they run.
func (c Config) deliveries() []natshard.Delivery {
	switch c.Delivery {
	case DeliveryDurable:
		return []natshard.Delivery{natshard.Durable}
	case DeliveryBoth:
		return []natshard.Delivery{natshard.Core, natshard.Durable}
	}
	return []natshard.Delivery{natshard.Core}
}

// DefaultMsgs is --msgs's default per delivery mode, so that each mode's
// default run stays well under a minute: JetStream stores each message
// of durable delivery on disk and acknowledges it, which handles about
// 1/60 of core NATS's messages per second on docs/BENCHMARKS.md's machine.
var DefaultMsgs = map[natshard.Delivery]int{natshard.Core: 300_000, natshard.Durable: 30_000}

// msgsFor is the messages per throughput run of delivery d.
func (c Config) msgsFor(d natshard.Delivery) int {
	if c.Msgs != 0 {
		return c.Msgs
	}
	return DefaultMsgs[d]
}

// typeOf is the name of the bench's type of delivery d: --type for core
// delivery, <type>-durable for durable (a type's delivery is stored with
// it, and both may run on one server).
func (c Config) typeOf(d natshard.Delivery) string {
	if d == natshard.Durable {
		return c.Type + "-durable"
	}
	return c.Type
}

// minKVSize is the smallest kv payload: {"op":"set","key":"v","value":""}.
const minKVSize = 34

// replicas is the replicas of the bench type and the raw streams.
func (c Config) replicas() int {
	switch {
	case c.Replicas > 0:
		return c.Replicas
	case c.NATS != "":
		return 1
	}
	return min(c.Servers, 3)
}

// Validate names the first flag at fault, in an error that wraps ErrUsage.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrUsage}, args...)...)
	}
	for _, d := range c.deliveries() {
		if _, err := protocol.NewSubjects(c.DataPrefix, c.ControlPrefix, c.typeOf(d)); err != nil {
			return bad("%v", err)
		}
	}
	switch {
	case c.Timeout <= 0:
		return bad("--timeout must be positive")
	case c.Regions < 1 || c.Regions > 64:
		return bad("--regions must be 1..64, not %d", c.Regions)
	case c.Shards < 1 || c.Shards > protocol.MaxShards:
		return bad("--shards must be 1..%d, not %d", protocol.MaxShards, c.Shards)
	case c.Kind != "echo" && c.Kind != "kv":
		return bad("--kind must be echo or kv, not %q", c.Kind)
	case c.Entities < 1:
		return bad("--entities must be at least 1")
	case c.Pubs < 1 || c.Pubs > 256:
		return bad("--pubs must be 1..256, not %d", c.Pubs)
	case c.msgsFor(natshard.Core) < c.Pubs || c.msgsFor(natshard.Durable) < c.Pubs:
		return bad("--msgs (%d) must be at least --pubs (%d)", min(c.msgsFor(natshard.Core), c.msgsFor(natshard.Durable)), c.Pubs)
	case c.Size < 1 || c.Size > 1<<20:
		return bad("--size must be 1..%d bytes, not %d", 1<<20, c.Size)
	case c.Kind == "kv" && c.Size < minKVSize:
		return bad("--size must be at least %d with --kind kv (a set request)", minKVSize)
	case c.Window < 1:
		return bad("--window must be at least 1")
	case c.Rounds < 1:
		return bad("--rounds must be at least 1")
	case c.Requests < 0:
		return bad("--requests must be 0 or more")
	case c.Callers < 0 || c.Callers > 10_000:
		return bad("--callers must be 0..10000, not %d", c.Callers)
	case c.LowRate <= 0 || c.LoadSeconds <= 0 || c.LoadSeconds > 600:
		return bad("--low-rate must be positive and --load-seconds 0..600, not %v and %v", c.LowRate, c.LoadSeconds)
	case c.Servers != 1 && c.Servers != 3 && c.Servers != 5:
		return bad("--servers must be 1, 3 or 5, not %d", c.Servers)
	case c.NATS != "" && c.Servers != 1:
		return bad("--servers starts embedded servers: not with --nats")
	case c.Replicas < 0 || c.Replicas > 5 || (c.NATS == "" && c.Replicas > c.Servers):
		return bad("--replicas must be 1..5, and at most --servers (%d) with embedded servers, not %d", c.Servers, c.Replicas)
	case c.BestConsumers < 1 || c.BestConsumers > c.Shards:
		return bad("--best-consumers must be 1..--shards (%d), not %d", c.Shards, c.BestConsumers)
	case c.Delivery != DeliveryCore && c.Delivery != DeliveryDurable && c.Delivery != DeliveryBoth:
		return bad("--delivery must be core, durable or both, not %q", c.Delivery)
	case (c.Handoff || c.Failover) && c.Delivery == DeliveryDurable:
		return bad("--handoff and --failover measure core delivery: use --delivery core or both")
	case (c.Handoff || c.Failover) && c.Regions < 2:
		return bad("--handoff and --failover need --regions 2 or more")
	case c.HandoffEntities < 1 || c.Moves < 1 || c.Kills < 1:
		return bad("--handoff-entities, --moves and --kills must be at least 1")
	case c.Rate <= 0:
		return bad("--rate must be positive")
	case c.CPUProfile != "" && c.SideProfiles != "":
		return bad("--cpuprofile and --side-profiles cannot both be given: Go takes one CPU profile at a time")
	}
	if c.SideProfiles != "" {
		// Written after the rounds: a directory that is not there would
		// otherwise be found only once the bench has run.
		if fi, err := os.Stat(filepath.Dir(c.SideProfiles)); err != nil || !fi.IsDir() {
			return bad("--side-profiles %s: no directory %s to write the profiles in", c.SideProfiles, filepath.Dir(c.SideProfiles))
		}
	}
	return nil
}
