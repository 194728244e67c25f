package benchlab

import (
	"fmt"
	"runtime"

	"github.com/nats-io/nats-server/v2/server"
)

// Result is what shardctl bench prints; --json prints it as is.
// Ratio, Throughput, Latency, Handoff and Failover are core delivery's
// (absent with --delivery durable), Durable the durable run's.
type Result struct {
	// Ratio is natshard's throughput over raw NATS's, in the same run:
	// the median over the rounds of each round's ratio.
	Ratio      float64           `json:"ratio,omitzero"`
	Config     ConfigView        `json:"config"`
	Machine    MachineView       `json:"machine"`
	Throughput ThroughputResult  `json:"throughput,omitzero"`
	Latency    *LatencyResult    `json:"latency,omitempty"`
	Concurrent *ConcurrentResult `json:"concurrent,omitempty"`
	Pipelined  *PipelinedResult  `json:"pipelined,omitempty"`
	Handoff    *HandoffResult    `json:"handoff,omitempty"`
	Failover   *FailoverResult   `json:"failover,omitempty"`
	Durable    *DurableResult    `json:"durable,omitempty"`
	// LoadLatency is core delivery's latency under load (--load-latency).
	LoadLatency []LoadLatency `json:"load_latency,omitempty"`
	Seconds     float64       `json:"seconds"`
	Notes       []string      `json:"notes,omitempty"`
}

func newResult(c Config) *Result {
	server := "embedded"
	if c.Servers > 1 {
		server = fmt.Sprintf("embedded, %d servers", c.Servers)
	}
	if c.NATS != "" {
		server = c.NATS
	}
	return &Result{
		Config: ConfigView{Server: server, Type: c.Type, Regions: c.Regions, Shards: c.Shards, Kind: c.Kind, Entities: c.Entities,
			Msgs: c.msgsFor(c.deliveries()[0]), Size: c.Size, Pubs: c.Pubs, Window: c.Window, Rounds: c.Rounds, Requests: c.Requests, Callers: c.Callers, Delivery: c.Delivery,
			Servers: c.Servers, Replicas: c.replicas(), LoadSeconds: c.LoadSeconds},
		Machine: machine(),
	}
}

// DurableResult is the durable run: the same workload sent to a type of
// durable delivery through JetStream (each publish acknowledged, at most
// --window of them in flight), beside raw JetStream twice, with streams
// of the same configuration and the same publishers: in the type's shape
// ("raw": per shard a pull consumer configured as the type's, on one
// connection per region, that acks each message), and in its best shape
// ("best": --best-consumers pull consumers, best.go). In
// Throughput and Latency, "natshard" is the durable type; a latency
// sample is the time from a publish to the entity's (or raw consumer's)
// handling of the message, one at a time.
type DurableResult struct {
	Msgs     int    `json:"msgs"` // per throughput run
	Type     string `json:"type"`
	Stream   string `json:"stream"`      // the type's (first) message stream
	Streams  int    `json:"streams"`     // how many message streams the type's messages are split over
	Raw      string `json:"raw_stream"`  // raw JetStream's (first) in the type's shape
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
	Throughput ThroughputResult `json:"throughput"`
	Latency    *LatencyResult   `json:"latency,omitempty"`
	// LoadLatency is the durable type's latency under load (--load-latency).
	LoadLatency []LoadLatency `json:"load_latency,omitempty"`
}

type ConfigView struct {
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

type MachineView struct {
	Go         string `json:"go"`
	OS         string `json:"os"`
	CPUs       int    `json:"cpus"`
	NATSServer string `json:"nats_server"`
}

// ThroughputResult: each round runs both sides back to back; Ratio is
// the median of the rounds' ratios, which cancels the machine's slower
// swings better than the ratio of the medians.
type ThroughputResult struct {
	Natshard    ThroughputSide `json:"natshard"`
	Raw         ThroughputSide `json:"raw"`
	Ratio       float64        `json:"ratio"`
	RoundsRatio []float64      `json:"rounds_ratio"`
	// CPURatio is raw's CPU per message over natshard's (median of the
	// rounds' ratios): what throughput ratio the machine would give if
	// it were CPU-bound and not shared.
	CPURatio float64 `json:"cpu_ratio"`
	// Best is raw JetStream in its best shape (durable delivery only),
	// and the ratios of natshard against it, as Ratio and CPURatio.
	Best            *ThroughputSide `json:"best,omitempty"`
	BestRatio       float64         `json:"best_ratio,omitzero"`
	BestRoundsRatio []float64       `json:"best_rounds_ratio,omitempty"`
	BestCPURatio    float64         `json:"best_cpu_ratio,omitzero"`
}

// ThroughputSide: Sent and Received are totals over the rounds; the rates
// are over the rounds, counted at the receiving side.
type ThroughputSide struct {
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

type LatencyResult struct {
	Natshard  LatencySide `json:"natshard"`
	Raw       LatencySide `json:"raw"`
	P50DiffUS float64     `json:"p50_diff_us"` // natshard p50 - raw p50
}

type LatencySide struct {
	Count  int     `json:"count"`
	Errors int     `json:"errors"`
	P50US  float64 `json:"p50_us"`
	P99US  float64 `json:"p99_us"`
	P999US float64 `json:"p999_us"`
	MaxUS  float64 `json:"max_us"`
}

// ConcurrentResult is the run of concurrent callers: Callers goroutines
// share Requests requests per round, each sending one and waiting for
// its answer, through natshard.Client.Request (to the echo entities) or
// nc.Request (to the raw responders), on the same connection; Rounds
// rounds per side, the sides taking turns going first. Ratio is the
// median of the rounds' ratios, natshard over raw.
type ConcurrentResult struct {
	Callers int `json:"callers"`
	RequestRuns
}

// PipelinedResult is the run of pipelined requests: one publisher keeps
// Window requests in flight on the requester's connection, their answers
// counted on one reply subject, to the echo entities or to the raw
// responders (a plain responder in the bench's process); Rounds rounds
// per side, alternating. Ratio is the median of the rounds' ratios.
type PipelinedResult struct {
	Window int `json:"window"`
	RequestRuns
}

// RequestRuns are the rounds of a requests' run, natshard's and raw
// NATS's taking turns (see alternate).
type RequestRuns struct {
	Requests    int            `json:"requests"` // per round and side
	Rounds      int            `json:"rounds"`
	Natshard    ConcurrentSide `json:"natshard"`
	Raw         ConcurrentSide `json:"raw"`
	Ratio       float64        `json:"ratio"`
	RoundsRatio []float64      `json:"rounds_ratio"`
}

type ConcurrentSide struct {
	ReqsPerSec   float64   `json:"reqs_per_sec"` // median of the rounds
	RoundsPerSec []float64 `json:"rounds_reqs_per_sec"`
	Errors       int64     `json:"errors"`
}

type HandoffResult struct {
	Entities int       `json:"entities"`
	Moves    int       `json:"moves"`
	Rate     float64   `json:"rate"`
	P50MS    float64   `json:"p50_ms"`
	P99MS    float64   `json:"p99_ms"`
	MaxMS    float64   `json:"max_ms"`
	Samples  []float64 `json:"samples_ms"`
}

type FailoverResult struct {
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

func machine() MachineView {
	return MachineView{Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH, CPUs: runtime.NumCPU(), NATSServer: server.VERSION}
}
