package benchlab

import (
	"context"
	"io"
	"os"
	"runtime/pprof"
	"time"

	"github.com/natshard/natshard"
)

// Run measures what cfg asks for and returns the figures. It draws its
// progress on stderr when that is a terminal (or cfg.Progress). With
// cfg.NATS it creates types and streams of its own on that server and
// deletes them at the end; otherwise it runs on embedded servers, which it
// stops. An error of the configuration wraps ErrUsage.
func Run(ctx context.Context, cfg Config, stderr io.Writer) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	start := time.Now()
	prog := newProgress(stderr, cfg.Progress)
	defer prog.clear()
	if cfg.NATS == "" {
		prog.note("starting NATS")
	}
	srv, err := OpenServer(cfg.NATS, cfg.Servers)
	if err != nil {
		return nil, err
	}
	defer srv.Close()
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
	res := newResult(cfg)
	sides := NewSideProfiles(cfg.SideProfiles)
	for _, d := range cfg.deliveries() {
		if err := measure(ctx, cfg, srv, d, prog, profile, sides, res); err != nil {
			return nil, err
		}
	}
	if du := res.Durable; du != nil && res.Throughput.Natshard.MsgsPerSec > 0 {
		du.CoreRatio = du.Throughput.Natshard.MsgsPerSec / res.Throughput.Natshard.MsgsPerSec
	}
	prog.clear()
	res.Seconds = time.Since(start).Seconds()
	if cfg.MemProfile != "" {
		if err := writeAllocProfile(cfg.MemProfile); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// measure runs the workloads of delivery d on a system of its own on srv,
// which it closes at the end, and fills res with the figures.
func measure(ctx context.Context, cfg Config, srv *Server, d natshard.Delivery, prog *progress, profile func() error, sides *SideProfiles, res *Result) error {
	prog.note("starting %d regions and a coordinator of %s delivery", cfg.Regions, d)
	t := &tally{}
	sys, err := startLabSystem(ctx, cfg, srv, d, t)
	if err != nil {
		return err
	}
	defer sys.Close()
	b, err := newBench(ctx, cfg, sys, t, prog)
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

// startLabSystem creates the type of delivery d on srv, with entities
// of cfg.Kind counted by t, never rebalanced but when asked; starts
// cfg.Regions regions and a coordinator, and waits until every shard is
// active and served live.
func startLabSystem(ctx context.Context, cfg Config, srv *Server, d natshard.Delivery, t *tally) (*System, error) {
	sys, err := NewSystem(ctx, srv, SystemConfig{
		Type: cfg.typeOf(d), Kind: cfg.Kind, Delivery: d, Shards: cfg.Shards, Replicas: cfg.replicas(),
		MinRegions: cfg.Regions, RebalanceInterval: natshard.Off,
		DataPrefix: cfg.DataPrefix, ControlPrefix: cfg.ControlPrefix, Timeout: cfg.Timeout,
		Entity: t.entity(cfg.Kind), Exclusive: cfg.NATS != "",
	})
	if err != nil {
		return nil, err
	}
	if err := startLab(ctx, cfg, sys); err != nil {
		sys.Close()
		return nil, err
	}
	return sys, nil
}

func startLab(ctx context.Context, cfg Config, sys *System) error {
	for range cfg.Regions {
		if _, err := sys.StartRegion(ctx, ""); err != nil {
			return err
		}
	}
	if err := sys.StartCoordinator(ctx); err != nil {
		return err
	}
	_, err := sys.WaitBalanced(ctx, 60*time.Second)
	return err
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
