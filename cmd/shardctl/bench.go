package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/nats-io/nuid"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/protocol"
)

// benchUsage is the first line of shardctl bench --help.
const benchUsage = "Usage: shardctl bench [flags] (no flags: the default workload on an embedded NATS server, under a minute)"

// parseBench parses bench's flags. Global flags given before "bench"
// (global: the flag set shardctl parsed) are the defaults, except that
// --nats counts only when given: NATS_URL is not used, so that a bench
// never loads a server by accident.
func parseBench(global *flag.FlagSet, args []string, stderr io.Writer) (c benchlab.Config, asJSON bool, err error) {
	c = benchlab.Config{Type: "bench", Timeout: 5 * time.Second}
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
			asJSON = true
		case "creds", "tls-cert", "tls-key", "tls-ca":
			// Visit sees flags set on the command line only, not NATS_CREDS
			// and the like from the environment, which bench ignores.
			secured = "--" + f.Name
		}
	})
	if secured != "" {
		// bench creates (and deletes) a type of its own, which none of
		// the least-privilege roles of shardctl auth may do.
		return c, false, fmt.Errorf("%w: bench does not take %s: it creates its own type, which no natshard role may; run it on its embedded server or against a server without auth", errUsage, secured)
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
	fs.BoolVar(&asJSON, "json", asJSON, "print JSON instead of a table")
	fs.IntVar(&c.Regions, "regions", 2, "regions, each on a connection of its own")
	fs.IntVar(&c.Shards, "shards", protocol.DefaultShards, "shards of the bench type")
	fs.StringVar(&c.Kind, "kind", "echo", "entities: echo (answer the payload) or kv (persistent documents: set per message, get per request)")
	fs.IntVar(&c.Entities, "entities", 1000, "entities the messages go to, round-robin")
	fs.IntVar(&c.Msgs, "msgs", 0, fmt.Sprintf("messages per throughput run (default %d in core delivery, %d in durable)", benchlab.DefaultMsgs[natshard.Core], benchlab.DefaultMsgs[natshard.Durable]))
	fs.IntVar(&c.Size, "size", 128, "payload bytes")
	fs.IntVar(&c.Pubs, "pubs", 2, "publishers, each on a connection of its own")
	fs.IntVar(&c.Window, "window", 20_000, "most messages published and not yet received (flow control, both sides)")
	fs.IntVar(&c.Rounds, "rounds", 5, "throughput runs per side, raw and natshard alternating; the median is reported")
	fs.IntVar(&c.Requests, "requests", 5000, fmt.Sprintf("requests per side in the latency run, and %d times that per round in the concurrent (--callers) and pipelined (%d in flight) runs; durable: messages published one at a time, publish to handled (0: none)", benchlab.RequestFactor, benchlab.PipelineWindow))
	fs.IntVar(&c.Callers, "callers", 64, fmt.Sprintf("core delivery: callers sharing the concurrent run's requests, natshard.Client against nc.Request; %d rounds per side, the sides taking turns (0, or --requests 0: no such run)", benchlab.RequestRounds))
	fs.StringVar(&c.Delivery, "delivery", benchlab.DeliveryCore, "what to measure: core (core NATS beside raw NATS), durable (a type of durable delivery, publishes acknowledged by JetStream, beside raw JetStream) or both, one after the other")
	fs.IntVar(&c.BestConsumers, "best-consumers", 1, "durable delivery: pull consumers of raw JetStream in its best shape, the baseline of the ratio (more than 1: the shards split among them by filter subjects)")
	fs.BoolVar(&c.LoadLatency, "load-latency", false, "also measure latency under load, natshard alone: publish to handled and request round trip, p50/p90/p99, at --low-rate and at 80 % of the maximum of the run (publishes: of what the same open loop handles when sent at the throughput rounds' rate)")
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
		return c, false, flagErr(err)
	}
	if fs.NArg() > 0 {
		return c, false, fmt.Errorf("%w: bench takes no arguments, got %q", errUsage, fs.Args())
	}
	fs.Visit(func(f *flag.Flag) { typeGiven = typeGiven || f.Name == "type" })
	if c.NATS != "" && !typeGiven {
		c.Type = "bench-" + strings.ToLower(nuid.Next()[14:])
	}
	return c, asJSON, nil
}

// runBench is shardctl bench: the flags, benchlab.Run, the figures as a
// table or as JSON.
func runBench(ctx context.Context, global *flag.FlagSet, args []string, stdout, stderr io.Writer) error {
	cfg, asJSON, err := parseBench(global, args, stderr)
	if err != nil {
		return err
	}
	res, err := benchlab.Run(ctx, cfg, stderr)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(stdout, res)
	}
	return printBench(stdout, res)
}

// printBench writes the summary tables of r.
func printBench(out io.Writer, r *benchlab.Result) error {
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
		split := ""
		if d.Streams > 1 {
			split = fmt.Sprintf(" (first of %d each: shard s in stream s mod %d)", d.Streams, d.Streams)
		}
		fmt.Fprintf(out, "\ndurable delivery: %d msgs per round, type %s, streams %s and %s%s (%s storage, replicas %d), publishes acknowledged\n",
			d.Msgs, d.Type, d.Stream, d.Raw, split, d.Storage, d.Replicas)
		t := d.Throughput
		if b := t.Best; b != nil {
			fmt.Fprintf(out, "\nagainst raw JetStream in its best shape (%s: %d pull consumers, acks at once, not confirmed):\n", d.Best, d.BestConsumers)
			rows := throughputRows(benchlab.ThroughputResult{Natshard: t.Natshard, Raw: *b, Ratio: t.BestRatio, RoundsRatio: t.BestRoundsRatio, CPURatio: t.BestCPURatio})
			rows = append(rows, []any{"acked (publish errors)", fmt.Sprintf("%d (%d)", t.Natshard.Acked, t.Natshard.PublishErrors), fmt.Sprintf("%d (%d)", b.Acked, b.PublishErrors), ""})
			if err := table(out, []string{"", "NATSHARD DURABLE", "RAW JETSTREAM, BEST", "RATIO/DIFF"}, rows); err != nil {
				return err
			}
			fmt.Fprintf(out, "\nagainst raw JetStream in the type's shape (%s: a consumer per shard, in the type's streams):\n", d.Raw)
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
	if err := loadTable(out, "core", c.LoadSeconds, r.LoadLatency); err != nil {
		return err
	}
	if d := r.Durable; d != nil {
		if err := loadTable(out, "durable", c.LoadSeconds, d.LoadLatency); err != nil {
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
func throughputRows(t benchlab.ThroughputResult) [][]any {
	return [][]any{
		{"msgs/s (median)", fmt.Sprintf("%.0f", t.Natshard.MsgsPerSec), fmt.Sprintf("%.0f", t.Raw.MsgsPerSec), fmt.Sprintf("x%.2f (median of rounds)", t.Ratio)},
		{"msgs/s (rounds)", joinRates(t.Natshard.RoundsPerSec, "%.0f"), joinRates(t.Raw.RoundsPerSec, "%.0f"), joinRates(t.RoundsRatio, "%.2f")},
		{"CPU us/msg (median)", fmt.Sprintf("%.2f", t.Natshard.CPUPerMsgUS), fmt.Sprintf("%.2f", t.Raw.CPUPerMsgUS), fmt.Sprintf("x%.2f (raw/natshard)", t.CPURatio)},
		{"received/sent", fmt.Sprintf("%d/%d", t.Natshard.Received, t.Natshard.Sent), fmt.Sprintf("%d/%d", t.Raw.Received, t.Raw.Sent), ""},
	}
}

// latencyRows are the rows of a table of l (none for nil): what names a
// sample, count what they are.
func latencyRows(l *benchlab.LatencyResult, what, count string) [][]any {
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

// loadRows are the rows of the latency table: the rates asked for, and
// those reached where the bench could not send as fast.
func loadRows(rows []benchlab.LoadLatency) [][]any {
	ms := func(us float64) string { return fmt.Sprintf("%.2f", us/1e3) }
	var out [][]any
	for _, r := range rows {
		rate := func(asked, got float64) string {
			if got < 0.95*asked {
				return fmt.Sprintf("%.0f (of %.0f)", got, asked)
			}
			return fmt.Sprintf("%.0f", asked)
		}
		out = append(out, []any{r.Load, rate(r.Rate, r.Handled.Rate),
			ms(r.Handled.P50US), ms(r.Handled.P90US), ms(r.Handled.P99US),
			rate(r.ReqRate, r.Request.Rate), ms(r.Request.P50US), ms(r.Request.P90US), ms(r.Request.P99US),
			fmt.Sprintf("%d/%d", r.Handled.Errors, r.Request.Errors)})
	}
	return out
}

// loadTable prints the latency table of delivery, if measured, and what
// its high load is a share of.
func loadTable(out io.Writer, delivery string, seconds float64, rows []benchlab.LoadLatency) error {
	if len(rows) == 0 {
		return nil
	}
	fmt.Fprintf(out, "\nlatency under load, %s delivery (natshard alone, %.0f s per load):\n", delivery, seconds)
	if err := table(out, loadHeader, loadRows(rows)); err != nil {
		return err
	}
	for _, r := range rows {
		if r.Max > 0 {
			fmt.Fprintf(out, "%s of the publishes' maximum: %.0f msgs/s handled by the same open loop sent at the throughput rounds' %.0f\n", r.Load, r.Max, r.ClosedMax)
		}
	}
	return nil
}

var loadHeader = []string{"LOAD", "MSGS/S", "HANDLED P50 MS", "P90", "P99", "REQ/S", "REQUEST P50 MS", "P90", "P99", "ERRORS"}
