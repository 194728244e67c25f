package web_test

import (
	"context"
	"log"
	"net/http"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/web"
	"github.com/prometheus/client_golang/prometheus"
)

// A Go service serves its node's metrics, probes and shard map on a mux
// of its own.
func ExampleNew() {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	node, err := natshard.Start(ctx, natshard.Options{Metrics: reg},
		natshard.Type{Name: "cart", Entity: newEcho})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/", web.New(node, web.Options{Gatherer: reg}))
	go func() { log.Println(http.ListenAndServe("127.0.0.1:9090", mux)) }()
	if err := node.Serve(ctx); err != nil {
		log.Fatal(err)
	}
}
