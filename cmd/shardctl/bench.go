package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/protocol"
)

// benchConfig is shardctl bench's command line.
type benchConfig struct {
	NATS          string // "": an embedded server
	Type          string
	DataPrefix    string
	ControlPrefix string
	Timeout       time.Duration
	JSON          bool

	Regions  int
	Shards   int
	Kind     string
	Entities int
	Msgs     int // 0: defaultMsgs of each delivery mode
	Size     int
	Pubs     int
	Window   int
	Rounds   int
	Requests int
	Callers  int    // concurrent callers of the client run (0: none)
	Delivery string // core, durable or both
	// BestConsumers: the pull consumers of raw JetStream in its best
	// shape (durable delivery; bench_best.go).
	BestConsumers int
	// LoadLatency: measure the latency tables under load (bench_loadlat.go).
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

// benchUsage is the first line of shardctl bench --help.
const benchUsage = "Usage: shardctl bench [flags] (no flags: the default workload on an embedded NATS server, under a minute)"

// parseBench parses bench's flags. Global flags given before "bench"
// (global: the flag set shardctl parsed) are the defaults, except that
// --nats counts only when given: NATS_URL is not used, so that a bench
// never loads a server by accident.
func parseBench(global *flag.FlagSet, args []string, stderr io.Writer) (benchConfig, error) {
	c := benchConfig{Type: "bench", Timeout: 5 * time.Second}
	var secured string
	global.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "nats":
			c.NATS = f.Value.String()
		case "type":
			c.Type = f.Value.String()
		case "data-prefix":
			c.DataPrefix = f.Value.String()
		case "control-prefix":
			c.ControlPrefix = f.Value.String()
		case "timeout":
			c.Timeout = f.Value.(flag.Getter).Get().(time.Duration)
		case "json":
			c.JSON = true
		case "creds", "tls-cert", "tls-key", "tls-ca":
			// Visit sees flags set on the command line only, not NATS_CREDS
			// and the like from the environment, which bench ignores.
			secured = "--" + f.Name
		}
	})
	if secured != "" {
		// bench creates (and deletes) a type of its own, which none of
		// the least-privilege roles of shardctl auth may do.
		return c, fmt.Errorf("%w: bench does not take %s: it creates its own type, which no natshard role may; run it on its embedded server or against a server without auth", errUsage, secured)
	}
	typeGiven := c.Type != "bench"
	fs := flag.NewFlagSet("shardctl bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.NATS, "nats", c.NATS, "use this NATS server (JetStream enabled) instead of an embedded one")
	fs.IntVar(&c.Servers, "servers", 1, "embedded NATS servers: 1, or a cluster of 3 or 5 (not with --nats)")
	fs.IntVar(&c.Replicas, "replicas", 0, "replicas of the bench type's bucket and streams, and of the raw streams (default: --servers, at most 3; 1 with --nats)")
	fs.StringVar(&c.Type, "type", c.Type, "entity type of the bench (with --nats: bench-<random> unless given; it must not exist, and is deleted at the end); the durable run's is <type>-durable")
	fs.StringVar(&c.DataPrefix, "data-prefix", c.DataPrefix, "subject prefix of the data plane (default shard)")
	fs.StringVar(&c.ControlPrefix, "control-prefix", c.ControlPrefix, "subject prefix of the control plane (default $SHARD)")
	fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "bound on each request")
	fs.BoolVar(&c.JSON, "json", c.JSON, "print JSON instead of a table")
	fs.IntVar(&c.Regions, "regions", 2, "regions, each on a connection of its own")
	fs.IntVar(&c.Shards, "shards", protocol.DefaultShards, "shards of the bench type")
	fs.StringVar(&c.Kind, "kind", "echo", "entities: echo (answer the payload) or kv (persistent documents: set per message, get per request)")
	fs.IntVar(&c.Entities, "entities", 1000, "entities the messages go to, round-robin")
	fs.IntVar(&c.Msgs, "msgs", 0, fmt.Sprintf("messages per throughput run (default %d in core delivery, %d in durable)", defaultMsgs[natshard.Core], defaultMsgs[natshard.Durable]))
	fs.IntVar(&c.Size, "size", 128, "payload bytes")
	fs.IntVar(&c.Pubs, "pubs", 2, "publishers, each on a connection of its own")
	fs.IntVar(&c.Window, "window", 20_000, "most messages published and not yet received (flow control, both sides)")
	fs.IntVar(&c.Rounds, "rounds", 5, "throughput runs per side, raw and natshard alternating; the median is reported")
	fs.IntVar(&c.Requests, "requests", 5000, fmt.Sprintf("requests per side in the latency run, and %d times that per round in the concurrent (--callers) and pipelined (%d in flight) runs; durable: messages published one at a time, publish to handled (0: none)", requestFactor, pipelineWindow))
	fs.IntVar(&c.Callers, "callers", 64, fmt.Sprintf("core delivery: callers sharing the concurrent run's requests, natshard.Client against nc.Request; %d rounds per side, the sides taking turns (0, or --requests 0: no such run)", requestRounds))
	fs.StringVar(&c.Delivery, "delivery", deliveryCore, "what to measure: core (core NATS beside raw NATS), durable (a type of durable delivery, publishes acknowledged by JetStream, beside raw JetStream) or both, one after the other")
	fs.IntVar(&c.BestConsumers, "best-consumers", 1, "durable delivery: pull consumers of raw JetStream in its best shape, the baseline of the ratio (more than 1: the shards split among them by filter subjects)")
	fs.BoolVar(&c.LoadLatency, "load-latency", false, "also measure latency under load, natshard alone: publish to handled and request round trip, p50/p90/p99, at --low-rate and at 80 % of the maximum of the run")
	fs.Float64Var(&c.LowRate, "low-rate", 1000, "with --load-latency: the low load, messages (and requests) per second")
	fs.Float64Var(&c.LoadSeconds, "load-seconds", 3, "with --load-latency: seconds of each load")
	fs.BoolVar(&c.Handoff, "handoff", false, "also measure handoffs: move a shard of --handoff-entities active entities --moves times under load")
	fs.IntVar(&c.HandoffEntities, "handoff-entities", 1000, "active entities in the moving shard")
	fs.IntVar(&c.Moves, "moves", 20, "handoffs to measure")
	fs.Float64Var(&c.Rate, "rate", 2000, "messages/s of the background publisher during handoff and failover runs")
	fs.BoolVar(&c.Failover, "failover", false, "also measure crashes: kill a region --kills times, time its shards to parked and re-homed; then kill the coordinator --kills times, time a standby's takeover")
	fs.IntVar(&c.Kills, "kills", 3, "with --failover: region crashes to measure, then as many coordinator crashes")
	fs.BoolVar(&c.Progress, "progress", false, "show progress on stderr even when it is not a terminal")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the measured runs to this file")
	fs.StringVar(&c.SideProfiles, "side-profiles", "", "write a CPU profile of each side's throughput rounds (merged over the rounds) to `PREFIX`.<delivery>.natshard.prof and PREFIX.<delivery>.raw.prof; what natshard adds: go tool pprof -top -diff_base PREFIX.core.raw.prof PREFIX.core.natshard.prof (not with --cpuprofile: Go takes one CPU profile at a time)")
	fs.StringVar(&c.MemProfile, "memprofile", "", "write an allocation profile (pprof allocs) to this file at the end")
	fs.Usage = func() {
		fmt.Fprintln(stderr, benchUsage)
		fmt.Fprintln(stderr, "\nFlags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return c, flagErr(err)
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("%w: bench takes no arguments, got %q", errUsage, fs.Args())
	}
	fs.Visit(func(f *flag.Flag) { typeGiven = typeGiven || f.Name == "type" })
	if c.NATS != "" && !typeGiven {
		c.Type = "bench-" + strings.ToLower(nuid.Next()[14:])
	}
	return c, c.validate()
}

// Values of --delivery.
const (
	deliveryCore    = "core"
	deliveryDurable = "durable"
	deliveryBoth    = "both"
)

// deliveries lists the delivery modes to measure, in the order they run.
func (c benchConfig) deliveries() []natshard.Delivery {
	switch c.Delivery {
	case deliveryDurable:
		return []natshard.Delivery{natshard.Durable}
	case deliveryBoth:
		return []natshard.Delivery{natshard.Core, natshard.Durable}
	}
	return []natshard.Delivery{natshard.Core}
}

// defaultMsgs is --msgs's default per delivery mode, so that each mode's
// default run stays well under a minute: JetStream stores each message
// of durable delivery on disk and acknowledges it, which handles about
// 1/60 of core NATS's messages per second on docs/BENCHMARKS.md's machine.
var defaultMsgs = map[natshard.Delivery]int{natshard.Core: 300_000, natshard.Durable: 30_000}

// msgsFor is the messages per throughput run of delivery d.
func (c benchConfig) msgsFor(d natshard.Delivery) int {
	if c.Msgs != 0 {
		return c.Msgs
	}
	return defaultMsgs[d]
}

// typeOf is the name of the bench's type of delivery d: --type for core
// delivery, <type>-durable for durable (a type's delivery is stored with
// it, and both may run on one server).
func (c benchConfig) typeOf(d natshard.Delivery) string {
	if d == natshard.Durable {
		return c.Type + "-durable"
	}
	return c.Type
}

// minKVSize is the smallest kv payload: {"op":"set","key":"v","value":""}.
const minKVSize = 34

// replicas is the replicas of the bench type and the raw streams.
func (c benchConfig) replicas() int {
	switch {
	case c.Replicas > 0:
		return c.Replicas
	case c.NATS != "":
		return 1
	}
	return min(c.Servers, 3)
}

// validate names the first flag at fault.
func (c benchConfig) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{errUsage}, args...)...)
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
	case c.Delivery != deliveryCore && c.Delivery != deliveryDurable && c.Delivery != deliveryBoth:
		return bad("--delivery must be core, durable or both, not %q", c.Delivery)
	case (c.Handoff || c.Failover) && c.Delivery == deliveryDurable:
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

// runBench is shardctl bench.
func runBench(ctx context.Context, global *flag.FlagSet, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseBench(global, args, stderr)
	if err != nil {
		return err
	}
	start := time.Now()
	prog := newProgress(stderr, cfg.Progress)
	defer prog.clear()
	if cfg.NATS == "" {
		prog.note("starting NATS")
	}
	srv, err := openBenchServer(cfg)
	if err != nil {
		return err
	}
	defer srv.close()
	var prof *os.File
	defer func() {
		if prof != nil {
			pprof.StopCPUProfile()
			prof.Close()
		}
	}()
	// profile starts the CPU profile once, before the first measured run.
	profile := func() error {
		if cfg.CPUProfile == "" || prof != nil {
			return nil
		}
		f, err := os.Create(cfg.CPUProfile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		prof = f
		return nil
	}
	res := newBenchResult(cfg)
	sides := newSideProfiles(cfg.SideProfiles)
	for _, d := range cfg.deliveries() {
		if err := measure(ctx, cfg, srv, d, prog, profile, sides, res); err != nil {
			return err
		}
	}
	if du := res.Durable; du != nil && res.Throughput.Natshard.MsgsPerSec > 0 {
		du.CoreRatio = du.Throughput.Natshard.MsgsPerSec / res.Throughput.Natshard.MsgsPerSec
	}
	prog.clear()
	res.Seconds = time.Since(start).Seconds()
	if cfg.MemProfile != "" {
		if err := writeAllocProfile(cfg.MemProfile); err != nil {
			return err
		}
	}
	if cfg.JSON {
		return writeJSON(stdout, res)
	}
	return res.print(stdout)
}

// measure runs the workloads of delivery d on a system of its own on srv,
// which it closes at the end, and fills res with the figures.
func measure(ctx context.Context, cfg benchConfig, srv *benchServer, d natshard.Delivery, prog *progress, profile func() error, sides *sideProfiles, res *benchResult) error {
	prog.note("starting %d regions and a coordinator of %s delivery", cfg.Regions, d)
	sys, err := startBenchSystem(ctx, cfg, srv, cfg.typeOf(d), d)
	if err != nil {
		return err
	}
	defer sys.close()
	b, err := newBench(ctx, sys, prog)
	if err != nil {
		return err
	}
	defer b.close()
	b.sides = sides
	if err := profile(); err != nil {
		return err
	}
	if d == natshard.Durable {
		return b.runDurable(res)
	}
	return b.runCore(res)
}

func writeAllocProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// benchResult is what shardctl bench prints; --json prints it as is.
// Ratio, Throughput, Latency, Handoff and Failover are core delivery's
// (absent with --delivery durable), Durable the durable run's.
type benchResult struct {
	// Ratio is natshard's throughput over raw NATS's, in the same run:
	// the median over the rounds of each round's ratio.
	Ratio      float64           `json:"ratio,omitzero"`
	Config     benchConfigView   `json:"config"`
	Machine    machineView       `json:"machine"`
	Throughput throughputResult  `json:"throughput,omitzero"`
	Latency    *latencyResult    `json:"latency,omitempty"`
	Concurrent *concurrentResult `json:"concurrent,omitempty"`
	Pipelined  *pipelinedResult  `json:"pipelined,omitempty"`
	Handoff    *handoffResult    `json:"handoff,omitempty"`
	Failover   *failoverResult   `json:"failover,omitempty"`
	Durable    *durableResult    `json:"durable,omitempty"`
	// LoadLatency is core delivery's latency under load (--load-latency).
	LoadLatency []loadLatency `json:"load_latency,omitempty"`
	Seconds     float64       `json:"seconds"`
	Notes       []string      `json:"notes,omitempty"`
}

func newBenchResult(c benchConfig) *benchResult {
	server := "embedded"
	if c.Servers > 1 {
		server = fmt.Sprintf("embedded, %d servers", c.Servers)
	}
	if c.NATS != "" {
		server = c.NATS
	}
	return &benchResult{
		Config: benchConfigView{Server: server, Type: c.Type, Regions: c.Regions, Shards: c.Shards, Kind: c.Kind, Entities: c.Entities,
			Msgs: c.msgsFor(c.deliveries()[0]), Size: c.Size, Pubs: c.Pubs, Window: c.Window, Rounds: c.Rounds, Requests: c.Requests, Callers: c.Callers, Delivery: c.Delivery,
			Servers: c.Servers, Replicas: c.replicas(), LoadSeconds: c.LoadSeconds},
		Machine: machine(),
	}
}

// durableResult is the durable run: the same workload sent to a type of
// durable delivery through JetStream (each publish acknowledged, at most
// --window of them in flight), beside raw JetStream twice, with streams
// of the same configuration and the same publishers: in the type's shape
// ("raw": per shard a pull consumer configured as the type's, on one
// connection per region, that acks each message), and in its best shape
// ("best": --best-consumers pull consumers, bench_best.go). In
// Throughput and Latency, "natshard" is the durable type; a latency
// sample is the time from a publish to the entity's (or raw consumer's)
// handling of the message, one at a time.
type durableResult struct {
	Msgs     int    `json:"msgs"` // per throughput run
	Type     string `json:"type"`
	Stream   string `json:"stream"`      // the type's message stream
	Raw      string `json:"raw_stream"`  // raw JetStream's in the type's shape
	Best     string `json:"best_stream"` // raw JetStream's in its best shape
	Storage  string `json:"storage"`     // of the three streams
	Replicas int    `json:"replicas"`    // of the streams and their consumers
	// BestConsumers is how many consumers the best shape pulls from.
	BestConsumers int `json:"best_consumers"`
	// Ratio is the durable type's throughput over raw JetStream's in its
	// best shape, the target's baseline: the median of the rounds'
	// ratios (Throughput.BestRatio).
	Ratio float64 `json:"ratio"`
	// SameShapeRatio is the durable type's throughput over raw
	// JetStream's in the type's shape (Throughput.Ratio).
	SameShapeRatio float64 `json:"same_shape_ratio"`
	// CoreRatio is the durable type's median msgs/s over core delivery's,
	// when both ran (--delivery both).
	CoreRatio  float64          `json:"core_ratio,omitempty"`
	Throughput throughputResult `json:"throughput"`
	Latency    *latencyResult   `json:"latency,omitempty"`
	// LoadLatency is the durable type's latency under load (--load-latency).
	LoadLatency []loadLatency `json:"load_latency,omitempty"`
}

type benchConfigView struct {
	Server      string  `json:"server"` // "embedded" or the URL
	Type        string  `json:"type"`
	Regions     int     `json:"regions"`
	Shards      int     `json:"shards"`
	Kind        string  `json:"kind"`
	Entities    int     `json:"entities"`
	Msgs        int     `json:"msgs"`
	Size        int     `json:"size"`
	Pubs        int     `json:"pubs"`
	Window      int     `json:"window"`
	Rounds      int     `json:"rounds"`
	Requests    int     `json:"requests"`
	Callers     int     `json:"callers"`
	Delivery    string  `json:"delivery"`
	Servers     int     `json:"servers"`      // embedded servers (1 with --nats)
	LoadSeconds float64 `json:"load_seconds"` // of each load (--load-latency)
	Replicas    int     `json:"replicas"`     // of the type's bucket and streams
}

type machineView struct {
	Go         string `json:"go"`
	OS         string `json:"os"`
	CPUs       int    `json:"cpus"`
	NATSServer string `json:"nats_server"`
}

// throughputResult: each round runs both sides back to back; Ratio is
// the median of the rounds' ratios, which cancels the machine's slower
// swings better than the ratio of the medians.
type throughputResult struct {
	Natshard    throughputSide `json:"natshard"`
	Raw         throughputSide `json:"raw"`
	Ratio       float64        `json:"ratio"`
	RoundsRatio []float64      `json:"rounds_ratio"`
	// CPURatio is raw's CPU per message over natshard's (median of the
	// rounds' ratios): what throughput ratio the machine would give if
	// it were CPU-bound and not shared.
	CPURatio float64 `json:"cpu_ratio"`
	// Best is raw JetStream in its best shape (durable delivery only),
	// and the ratios of natshard against it, as Ratio and CPURatio.
	Best            *throughputSide `json:"best,omitempty"`
	BestRatio       float64         `json:"best_ratio,omitzero"`
	BestRoundsRatio []float64       `json:"best_rounds_ratio,omitempty"`
	BestCPURatio    float64         `json:"best_cpu_ratio,omitzero"`
}

// throughputSide: Sent and Received are totals over the rounds; the rates
// are over the rounds, counted at the receiving side.
type throughputSide struct {
	Sent         int64     `json:"sent"`
	Received     int64     `json:"received"`
	Errors       int64     `json:"errors"`       // natshard: messages an entity handled with an error (kv: a failed write)
	MsgsPerSec   float64   `json:"msgs_per_sec"` // median
	RoundsPerSec []float64 `json:"rounds_msgs_per_sec"`
	// CPUPerMsgUS is the CPU time the whole process (publishers, the
	// embedded server, receivers) used per message, median over the
	// rounds: steadier than msgs/s when other jobs share the machine.
	// 0 where it is not measured (not unix).
	CPUPerMsgUS float64 `json:"cpu_us_per_msg"`
	// Acked and PublishErrors count the publishes JetStream acknowledged
	// and those it refused or that failed (durable run only).
	Acked         int64 `json:"acked,omitempty"`
	PublishErrors int64 `json:"publish_errors,omitempty"`
}

type latencyResult struct {
	Natshard  latencySide `json:"natshard"`
	Raw       latencySide `json:"raw"`
	P50DiffUS float64     `json:"p50_diff_us"` // natshard p50 - raw p50
}

type latencySide struct {
	Count  int     `json:"count"`
	Errors int     `json:"errors"`
	P50US  float64 `json:"p50_us"`
	P99US  float64 `json:"p99_us"`
	P999US float64 `json:"p999_us"`
	MaxUS  float64 `json:"max_us"`
}

// concurrentResult is the run of concurrent callers: Callers goroutines
// share Requests requests per round, each sending one and waiting for
// its answer, through natshard.Client.Request (to the echo entities) or
// nc.Request (to the raw responders), on the same connection; Rounds
// rounds per side, the sides taking turns going first. Ratio is the
// median of the rounds' ratios, natshard over raw.
type concurrentResult struct {
	Callers int `json:"callers"`
	requestRuns
}

// pipelinedResult is the run of pipelined requests: one publisher keeps
// Window requests in flight on the requester's connection, their answers
// counted on one reply subject, to the echo entities or to the raw
// responders (a plain responder in the bench's process); Rounds rounds
// per side, alternating. Ratio is the median of the rounds' ratios.
type pipelinedResult struct {
	Window int `json:"window"`
	requestRuns
}

// requestRuns are the rounds of a requests' run, natshard's and raw
// NATS's taking turns (see alternate).
type requestRuns struct {
	Requests    int            `json:"requests"` // per round and side
	Rounds      int            `json:"rounds"`
	Natshard    concurrentSide `json:"natshard"`
	Raw         concurrentSide `json:"raw"`
	Ratio       float64        `json:"ratio"`
	RoundsRatio []float64      `json:"rounds_ratio"`
}

type concurrentSide struct {
	ReqsPerSec   float64   `json:"reqs_per_sec"` // median of the rounds
	RoundsPerSec []float64 `json:"rounds_reqs_per_sec"`
	Errors       int64     `json:"errors"`
}

type handoffResult struct {
	Entities int       `json:"entities"`
	Moves    int       `json:"moves"`
	Rate     float64   `json:"rate"`
	P50MS    float64   `json:"p50_ms"`
	P99MS    float64   `json:"p99_ms"`
	MaxMS    float64   `json:"max_ms"`
	Samples  []float64 `json:"samples_ms"`
}

type failoverResult struct {
	Kills        int       `json:"kills"`
	Rate         float64   `json:"rate"`
	ParkedP50MS  float64   `json:"parked_p50_ms"`
	ParkedMaxMS  float64   `json:"parked_max_ms"`
	RehomedP50MS float64   `json:"rehomed_p50_ms"`
	RehomedP99MS float64   `json:"rehomed_p99_ms"`
	RehomedMaxMS float64   `json:"rehomed_max_ms"`
	Rehomed      []float64 `json:"rehomed_ms"`
	// Coordinator crashes (as many as region crashes): from the kill of
	// the leading coordinator's node until a standby candidate answers as
	// the coordinator of a newer epoch.
	CoordinatorP50MS float64   `json:"coordinator_p50_ms"`
	CoordinatorMaxMS float64   `json:"coordinator_max_ms"`
	Coordinator      []float64 `json:"coordinator_ms"`
}

func machine() machineView {
	return machineView{Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH, CPUs: runtime.NumCPU(), NATSServer: server.VERSION}
}

// print writes the summary tables.
func (r *benchResult) print(out io.Writer) error {
	c := r.Config
	fmt.Fprintf(out, "natshard bench: %d regions, %d shards, %d %s entities, %d publishers, %d msgs x %d B, %d rounds; NATS %s\n",
		c.Regions, c.Shards, c.Entities, c.Kind, c.Pubs, c.Msgs, c.Size, c.Rounds, c.Server)
	fmt.Fprintf(out, "machine: %s, %d CPUs, %s, nats-server %s\n", r.Machine.OS, r.Machine.CPUs, r.Machine.Go, r.Machine.NATSServer)
	if len(r.Throughput.RoundsRatio) > 0 {
		fmt.Fprintln(out)
		rows := throughputRows(r.Throughput)
		rows = append(rows, latencyRows(r.Latency, "request", "requests")...)
		if cr := r.Concurrent; cr != nil {
			rows = append(rows,
				[]any{fmt.Sprintf("req/s, %d callers", cr.Callers), fmt.Sprintf("%.0f (Client)", cr.Natshard.ReqsPerSec), fmt.Sprintf("%.0f (nc.Request)", cr.Raw.ReqsPerSec), fmt.Sprintf("x%.2f (median of rounds)", cr.Ratio)},
				[]any{"req/s (rounds)", joinRates(cr.Natshard.RoundsPerSec, "%.0f"), joinRates(cr.Raw.RoundsPerSec, "%.0f"), joinRates(cr.RoundsRatio, "%.2f")})
		}
		if pr := r.Pipelined; pr != nil {
			rows = append(rows,
				[]any{fmt.Sprintf("req/s, %d in flight", pr.Window), fmt.Sprintf("%.0f (entities)", pr.Natshard.ReqsPerSec), fmt.Sprintf("%.0f (responder)", pr.Raw.ReqsPerSec), fmt.Sprintf("x%.2f (median of rounds)", pr.Ratio)},
				[]any{"req/s (rounds)", joinRates(pr.Natshard.RoundsPerSec, "%.0f"), joinRates(pr.Raw.RoundsPerSec, "%.0f"), joinRates(pr.RoundsRatio, "%.2f")})
		}
		if err := table(out, []string{"", "NATSHARD", "RAW NATS", "RATIO/DIFF"}, rows); err != nil {
			return err
		}
	}
	if d := r.Durable; d != nil {
		fmt.Fprintf(out, "\ndurable delivery: %d msgs per round, type %s, streams %s and %s (%s storage, replicas %d), publishes acknowledged\n",
			d.Msgs, d.Type, d.Stream, d.Raw, d.Storage, d.Replicas)
		t := d.Throughput
		if b := t.Best; b != nil {
			fmt.Fprintf(out, "\nagainst raw JetStream in its best shape (%s: %d pull consumers, acks at once, not confirmed):\n", d.Best, d.BestConsumers)
			rows := throughputRows(throughputResult{Natshard: t.Natshard, Raw: *b, Ratio: t.BestRatio, RoundsRatio: t.BestRoundsRatio, CPURatio: t.BestCPURatio})
			rows = append(rows, []any{"acked (publish errors)", fmt.Sprintf("%d (%d)", t.Natshard.Acked, t.Natshard.PublishErrors), fmt.Sprintf("%d (%d)", b.Acked, b.PublishErrors), ""})
			if err := table(out, []string{"", "NATSHARD DURABLE", "RAW JETSTREAM, BEST", "RATIO/DIFF"}, rows); err != nil {
				return err
			}
			fmt.Fprintf(out, "\nagainst raw JetStream in the type's shape (%s: a consumer per shard):\n", d.Raw)
		}
		rows := throughputRows(t)
		rows = append(rows, []any{"acked (publish errors)", fmt.Sprintf("%d (%d)", t.Natshard.Acked, t.Natshard.PublishErrors), fmt.Sprintf("%d (%d)", t.Raw.Acked, t.Raw.PublishErrors), ""})
		rows = append(rows, latencyRows(d.Latency, "publish to handled", "messages")...)
		if d.CoreRatio > 0 {
			rows = append(rows, []any{"msgs/s against core", "", "", fmt.Sprintf("x%.3f (durable/core natshard)", d.CoreRatio)})
		}
		if err := table(out, []string{"", "NATSHARD DURABLE", "RAW JETSTREAM, SAME SHAPE", "RATIO/DIFF"}, rows); err != nil {
			return err
		}
	}
	if len(r.LoadLatency) > 0 {
		fmt.Fprintf(out, "\nlatency under load, core delivery (natshard alone, %.0f s per load):\n", c.LoadSeconds)
		if err := table(out, loadHeader, loadRows(r.LoadLatency)); err != nil {
			return err
		}
	}
	if d := r.Durable; d != nil && len(d.LoadLatency) > 0 {
		fmt.Fprintf(out, "\nlatency under load, durable delivery (natshard alone, %.0f s per load):\n", c.LoadSeconds)
		if err := table(out, loadHeader, loadRows(d.LoadLatency)); err != nil {
			return err
		}
	}
	if h := r.Handoff; h != nil {
		fmt.Fprintf(out, "\nhandoff of a shard with %d active entities under %.0f msg/s, %d moves: decision to the new owner's first message p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
			h.Entities, h.Rate, h.Moves, h.P50MS, h.P99MS, h.MaxMS)
	}
	if f := r.Failover; f != nil {
		fmt.Fprintf(out, "\nregion crash under %.0f msg/s, %d kills: its shards parked p50 %.0f ms (max %.0f), re-homed p50 %.0f ms, p99 %.0f ms, max %.0f ms\n",
			f.Rate, f.Kills, f.ParkedP50MS, f.ParkedMaxMS, f.RehomedP50MS, f.RehomedP99MS, f.RehomedMaxMS)
		fmt.Fprintf(out, "coordinator crash, %d kills: a new coordinator answers after p50 %.0f ms, max %.0f ms\n",
			len(f.Coordinator), f.CoordinatorP50MS, f.CoordinatorMaxMS)
	}
	for _, n := range r.Notes {
		fmt.Fprintf(out, "note: %s\n", n)
	}
	fmt.Fprintf(out, "\n%.1f s in all\n", r.Seconds)
	return nil
}

// throughputRows are the rows of a table of t: natshard, raw, ratio.
func throughputRows(t throughputResult) [][]any {
	return [][]any{
		{"msgs/s (median)", fmt.Sprintf("%.0f", t.Natshard.MsgsPerSec), fmt.Sprintf("%.0f", t.Raw.MsgsPerSec), fmt.Sprintf("x%.2f (median of rounds)", t.Ratio)},
		{"msgs/s (rounds)", joinRates(t.Natshard.RoundsPerSec, "%.0f"), joinRates(t.Raw.RoundsPerSec, "%.0f"), joinRates(t.RoundsRatio, "%.2f")},
		{"CPU us/msg (median)", fmt.Sprintf("%.2f", t.Natshard.CPUPerMsgUS), fmt.Sprintf("%.2f", t.Raw.CPUPerMsgUS), fmt.Sprintf("x%.2f (raw/natshard)", t.CPURatio)},
		{"received/sent", fmt.Sprintf("%d/%d", t.Natshard.Received, t.Natshard.Sent), fmt.Sprintf("%d/%d", t.Raw.Received, t.Raw.Sent), ""},
	}
}

// latencyRows are the rows of a table of l (none for nil): what names a
// sample, count what they are.
func latencyRows(l *latencyResult, what, count string) [][]any {
	if l == nil {
		return nil
	}
	return [][]any{
		{what + " p50", us(l.Natshard.P50US), us(l.Raw.P50US), fmt.Sprintf("%+.0f us", l.P50DiffUS)},
		{what + " p99", us(l.Natshard.P99US), us(l.Raw.P99US), fmt.Sprintf("%+.0f us", l.Natshard.P99US-l.Raw.P99US)},
		{what + " p99.9", us(l.Natshard.P999US), us(l.Raw.P999US), fmt.Sprintf("%+.0f us", l.Natshard.P999US-l.Raw.P999US)},
		{count + " (errors)", fmt.Sprintf("%d (%d)", l.Natshard.Count, l.Natshard.Errors), fmt.Sprintf("%d (%d)", l.Raw.Count, l.Raw.Errors), ""},
	}
}

func us(v float64) string { return fmt.Sprintf("%.0f us", v) }

func joinRates(rs []float64, format string) string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = fmt.Sprintf(format, r)
	}
	return strings.Join(parts, " ")
}

// progress draws a bar on stderr when it is a terminal (or --progress).
type progress struct {
	out     io.Writer
	enabled bool
	stop    chan struct{}
	done    chan struct{}
	shown   bool
}

func newProgress(stderr io.Writer, force bool) *progress {
	enabled := force
	if f, ok := stderr.(*os.File); ok && !enabled {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			enabled = true
		}
	}
	return &progress{out: stderr, enabled: enabled}
}

// note shows a line of text until the next note, phase or clear.
func (p *progress) note(format string, args ...any) {
	if !p.enabled {
		return
	}
	p.clear()
	fmt.Fprintf(p.out, "\r\033[K%s", fmt.Sprintf(format, args...))
	p.shown = true
}

// phase draws label and a bar of done()/total every 200 ms until the next
// phase, note or clear.
func (p *progress) phase(label string, total int64, done func() int64) {
	if !p.enabled {
		return
	}
	p.clear()
	p.stop, p.done = make(chan struct{}), make(chan struct{})
	stop, finished := p.stop, p.done
	draw := func() {
		n := min(max(done(), 0), total)
		const width = 30
		fill := int(int64(width) * n / max(total, 1))
		fmt.Fprintf(p.out, "\r\033[K%-34s [%s%s] %3d%%", label, strings.Repeat("=", fill), strings.Repeat(" ", width-fill), 100*n/max(total, 1))
	}
	p.shown = true
	go func() {
		defer close(finished)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			draw()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
}

// clear ends the current phase and erases its line.
func (p *progress) clear() {
	if p.stop != nil {
		close(p.stop)
		<-p.done
		p.stop = nil
	}
	if p.shown {
		fmt.Fprint(p.out, "\r\033[K")
		p.shown = false
	}
}

var errNoProgress = errors.New("no message received for 10 s")
