// Package sidecar hosts the entities of natshard types in an HTTP
// application written in any language (the app): natshard's regions and
// coordinators run in this process, and every message to an entity becomes
// an HTTP call to the app. shardd --kind http --app URL is its thinnest
// user; docs/SIDECAR.md is the contract, with examples in Python and
// JavaScript.
//
// # The contract, in brief
//
// The node calls the app (base URL Config.App):
//
//	GET  /healthz                  ready when 2xx
//	POST /activate/{type}/{id}     the entity activates (404/405: no such callback, fine)
//	POST /entities/{type}/{id}     a message: body = payload; 2xx body = the reply,
//	                               another status = the entity's error (Natshard-Error)
//	POST /stop/{type}/{id}         the entity stops: passivation, handoff, shutdown
//
// with headers Natshard-Shard, Natshard-Msg-Id, Natshard-Request,
// Natshard-Headers and Natshard-State-Url. The id is escaped as a path
// segment. The app reads and writes entities' state through the state API
// that the App serves on loopback (Natshard-State-Url):
//
//	GET    /state/{type}/{id}      200 + ETag, or 404
//	PUT    /state/{type}/{id}      If-Match: "<ETag>" (or "0" / If-None-Match: * for none): 204 + ETag, 412 on conflict
//	DELETE /state/{type}/{id}      If-Match: 204, 412 on conflict
//
// # Guarantees
//
// An entity's calls (activate, messages, stop) reach the app one at a
// time, in the order its messages arrived; different entities' calls run
// concurrently, at most Config.Concurrency at once, on kept-alive
// connections. A call that exceeds Config.Timeout fails for the
// requester; the app may still be running it when the entity's next call
// arrives. State writes are compare-and-set on the revision, as with the
// kv kind: a write based on a stale read fails (412) and the app reads
// again.
//
// # Use
//
// Run does everything in order. By hand, for a Go program that also hosts
// types of its own:
//
//	app, err := sidecar.New(sidecar.Config{App: "http://127.0.0.1:8080"})
//	defer app.Close()                       // after the node stopped
//	err = app.WaitReady(ctx)                // before any region registers
//	node, err := natshard.Start(ctx, opts, app.Type(natshard.Type{Name: "counter"}), cart.Type())
//	app.Attach(node)                        // the state API serves; health checks begin
//	select { case <-ctx.Done(): case <-app.Down(): }
//	node.Stop(ctx)                          // graceful: the shards move first
//
// # Readiness and a dead app
//
// A process registers its regions only once its app answers GET /healthz.
// While it runs, an app that fails every health check for
// Config.DownAfter is down: Run leaves (node.Stop: its shards are handed
// off to processes whose app answers, losing no message; the stop
// callbacks are skipped) and returns ErrAppDown, so that a supervisor
// restarts the process, which registers again once its app answers.
// Fencing instead would drop the shards at once (messages sent until the
// coordinator parks them are lost) and register again at once, to be
// given shards it cannot serve.
package sidecar
