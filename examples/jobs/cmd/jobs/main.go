// Command jobs is a node of a job runner: jobs of steps (package jobs),
// durable and remembered, that go on through crashes and restarts. Run
// one, then as many more as you like, then ask them:
//
//	go run ./examples/jobs/cmd/jobs                                   # embedded NATS on 127.0.0.1:4222
//	go run ./examples/jobs/cmd/jobs -nats nats://127.0.0.1:4222 -region b
//	go run ./examples/jobs/cmd/jobs -nats nats://127.0.0.1:4222 start build-7 5 2s
//	go run ./examples/jobs/cmd/jobs -nats nats://127.0.0.1:4222 get build-7
//	nats sub 'jobs.running.>'                                         # the jobs that run
//
// Kill every node with -9 in the middle and start them again: the jobs go
// on where they were, each step once.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/jobs"
)

func main() {
	var opts natshard.Options
	flag.StringVar(&opts.NATS, "nats", "", "NATS server URL; empty starts an embedded server")
	flag.StringVar(&opts.Region, "region", "", "this node's region id (default: host-pid)")
	flag.StringVar(&opts.Server.Listen, "listen", natshard.DefaultListen, "the embedded server's address")
	flag.StringVar(&opts.Server.DataDir, "data-dir", natshard.DefaultDataDir(), "the embedded server's store")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	var err error
	if flag.NArg() == 0 {
		err = natshard.Run(ctx, opts, jobs.Type())
	} else {
		err = ask(ctx, opts.NATS, flag.Args())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "jobs:", err)
		os.Exit(1)
	}
}

// ask sends one request to a job and prints the job.
//
//	start <job> <steps> <every>
//	get <job>
func ask(ctx context.Context, url string, args []string) error {
	req := jobs.Request{}
	switch {
	case len(args) == 4 && args[0] == "start":
		steps, err := strconv.Atoi(args[2])
		if err != nil {
			return fmt.Errorf("steps %q is not a number", args[2])
		}
		every, err := time.ParseDuration(args[3])
		if err != nil {
			return fmt.Errorf("every %q: %w", args[3], err)
		}
		req = jobs.Request{Op: "start", Steps: steps, Every: jobs.Duration(every)}
	case len(args) == 2 && args[0] == "get":
		req.Op = "get"
	default:
		return errors.New("usage: jobs [-nats URL] start <job> <steps> <every> | get <job>")
	}
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	job, err := jobs.Key.Ref(natshard.NewClient(nc), args[1]).Ask(ctx, req)
	if err != nil {
		return err
	}
	out, err := json.Marshal(job)
	if err != nil {
		return err
	}
	fmt.Println(string(out))
	return nil
}
