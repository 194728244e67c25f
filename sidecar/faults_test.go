package sidecar_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/sidecar"
)

// faultApp misbehaves as its entities' ids say: slow-*, fail-*, teapot-*,
// big-*, redirect-* on messages, noactivate-* on activation, badstop-* on
// stop; ok-* answers its payload.
type faultApp struct {
	activations atomic.Int64 // of badstop-* entities
	stops       atomic.Int64 // asked of badstop-* entities
}

func (f *faultApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	parts := strings.SplitN(r.URL.Path, "/", 4)
	if r.URL.Path == "/healthz" || len(parts) != 4 {
		return
	}
	kind, id := parts[1], parts[3]
	switch {
	case kind == "activate" && strings.HasPrefix(id, "noactivate-"):
		http.Error(w, "no such entity", http.StatusInternalServerError)
	case kind == "activate" && strings.HasPrefix(id, "badstop-"):
		f.activations.Add(1)
	case kind == "stop" && strings.HasPrefix(id, "badstop-"):
		f.stops.Add(1)
		http.Error(w, "cannot flush", http.StatusInternalServerError)
	case kind != "entities":
		http.NotFound(w, r) // no lifecycle callbacks otherwise
	case strings.HasPrefix(id, "slow-"):
		// With the body read, the server notices that the caller gave
		// up (its connection closed) and cancels r's context.
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	case strings.HasPrefix(id, "fail-"):
		w.Header().Set(sidecar.HeaderError, "out of stock")
		w.WriteHeader(http.StatusInternalServerError)
		w.Write([]byte(`{"ok":false}`))
	case strings.HasPrefix(id, "refuse-"):
		w.Header().Set(sidecar.HeaderError, "insufficient funds")
		w.Header().Set(sidecar.HeaderErrorCode, "insufficient-funds")
		w.WriteHeader(http.StatusConflict)
		w.Write([]byte(`{"missing":5}`))
	case strings.HasPrefix(id, "teapot-"):
		w.WriteHeader(http.StatusTeapot)
	case strings.HasPrefix(id, "big-"):
		w.Write(bytes.Repeat([]byte("x"), 2<<20))
	case strings.HasPrefix(id, "redirect-"):
		http.Redirect(w, r, "/elsewhere", http.StatusFound)
	default:
		body := make([]byte, r.ContentLength)
		_, _ = r.Body.Read(body)
		w.Write(body)
	}
}

// rawApp accepts connections and answers every request with answer, raw
// bytes that are not the HTTP the contract asks for, until ln is closed.
func rawApp(t *testing.T, answer string) (string, net.Listener) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				if _, err := c.Read(buf); err == nil {
					c.Write([]byte(answer))
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String(), ln
}

// ours counts the goroutines of this process but the NATS server's (whose
// streams, made by the test, live on) and returns their stacks.
func ours() (int, string) {
	buf := make([]byte, 8<<20)
	var n int
	var kept []string
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if !strings.Contains(g, "nats-server/v2/server") {
			n++
			kept = append(kept, g)
		}
	}
	return n, strings.Join(kept, "\n\n")
}

// sockets counts this process's open sockets: its connections and
// listeners; -1 where /proc is not there.
func sockets() int {
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	n := 0
	for _, fd := range fds {
		if l, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil && strings.HasPrefix(l, "socket:") {
			n++
		}
	}
	return n
}

// TestAppFaults: an app that is slow, fails, answers garbage, too much, a
// redirect, refuses activations, fails its stops, or is gone: the
// requester gets a clear error every time (an *natshard.EntityError
// naming the cause), the process goes on, and once the node and the apps
// are closed, no goroutine and no connection is left.
func TestAppFaults(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	goroutines, _ := ours()
	socks := sockets()

	fa := &faultApp{}
	var conns atomic.Int64
	faultSrv := serve(t, fa, &conns)
	apps := map[string]*sidecar.App{}
	newApp := func(name, appURL string) natshard.Type {
		a, err := sidecar.New(sidecar.Config{App: appURL, Timeout: 500 * time.Millisecond, Concurrency: 4, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		apps[name] = a
		return a.Type(natshard.Type{Name: name, Shards: 4, IdleTimeout: 200 * time.Millisecond})
	}
	deadPort := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return "http://" + ln.Addr().String()
	}()
	garbageURL, garbage := rawApp(t, "garbage\r\n\r\n")
	cutURL, cut := rawApp(t, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
	types := []natshard.Type{
		newApp("faults", faultSrv.URL),
		newApp("garbage", garbageURL),
		newApp("cutshort", cutURL),
		newApp("gone", deadPort),
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	node, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: "a", Logger: quiet}, types...)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range apps {
		a.Attach(node)
	}
	client := node.Client()

	// expect: the request fails with an entity error saying want (one
	// of its |-separated texts), of code code (Natshard-Error-Code).
	expect := func(typ, id, want, code string) {
		t.Helper()
		t0 := time.Now()
		data, err := client.Request(ctx, typ, id, []byte("hello"))
		var ee *natshard.EntityError
		if !errors.As(err, &ee) || !slices.ContainsFunc(strings.Split(want, "|"), func(w string) bool { return strings.Contains(ee.Message, w) }) {
			t.Fatalf("%s %s: %q, %v; want an entity error saying %q", typ, id, data, err, want)
		}
		if ee.Code != code {
			t.Fatalf("%s %s: %q of code %q; want code %q", typ, id, ee.Message, ee.Code, code)
		}
		t.Logf("%s %s: %q (%s) after %s", typ, id, ee.Message, ee.Code, time.Since(t0).Round(time.Millisecond))
	}
	if data, err := client.Request(ctx, "faults", "ok-1", []byte("hello")); err != nil || string(data) != "hello" {
		t.Fatalf("ok-1: %q %v", data, err)
	}
	expect("faults", "slow-1", "app: no answer within 500ms (app timeout)", sidecar.CodeAppTimeout)
	expect("faults", "fail-1", "app: answered 500 Internal Server Error: out of stock", "http-500")
	expect("faults", "refuse-1", "app: answered 409 Conflict: insufficient funds", "insufficient-funds")
	expect("faults", "teapot-1", "app: answered 418 I'm a teapot", "http-418")
	expect("faults", "big-1", "is larger than", sidecar.CodeAppAnswerTooLarge)
	expect("faults", "redirect-1", "app: answered 302 Found", "http-302")
	expect("faults", "noactivate-1", "create entity: app: answered 500 Internal Server Error", "http-500")
	expect("garbage", "x", "malformed HTTP", sidecar.CodeAppUnreachable)
	expect("cutshort", "x", "its answer was cut short: unexpected EOF", sidecar.CodeAppUnreachable)
	expect("gone", "x", "connect: connection refused", sidecar.CodeAppUnreachable)
	// A declared error of the app's matches with errors.Is, and its
	// body (the details) is the app's.
	_, err = client.Request(ctx, "faults", "refuse-2", nil)
	if ee := (*natshard.EntityError)(nil); !errors.Is(err, natshard.NewError("insufficient-funds", "")) || !errors.As(err, &ee) || string(ee.Data) != `{"missing":5}` {
		t.Fatalf("refuse-2: %v, want insufficient-funds with the app's body", err)
	}
	// The error's body is the app's.
	_, err = client.Request(ctx, "faults", "fail-2", nil)
	if ee := (*natshard.EntityError)(nil); !errors.As(err, &ee) || string(ee.Data) != `{"ok":false}` {
		t.Fatalf("fail-2: %v, want the app's body", err)
	}
	// A failing stop is logged and the entity stops all the same: its
	// next message activates it again.
	if _, err := client.Request(ctx, "faults", "badstop-1", nil); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 30*time.Second, "badstop-1 passivated", func() bool { return fa.stops.Load() == 1 })
	if _, err := client.Request(ctx, "faults", "badstop-1", nil); err != nil {
		t.Fatal(err)
	}
	if n := fa.activations.Load(); n != 2 {
		t.Fatalf("badstop-1 activated %d times, want 2 (its failed stop ended the first incarnation)", n)
	}
	// The app goes away: its connections close, calls fail clearly (a
	// call may meet a kept-alive connection as it closes).
	faultSrv.Close()
	expect("faults", "ok-2", "connect: connection refused|closed the connection without answering", sidecar.CodeAppUnreachable)
	expect("faults", "ok-3", "connect: connection refused", sidecar.CodeAppUnreachable)

	if err := node.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, a := range apps {
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
	}
	garbage.Close()
	cut.Close()
	natstest.Eventually(t, 30*time.Second, "the fault app's connections closed", func() bool { return conns.Load() == 0 })
	natstest.Eventually(t, 10*time.Second, "no goroutine or socket left (a leak)", func() error {
		if n, stacks := ours(); n > goroutines || sockets() > socks {
			return fmt.Errorf("%d goroutines (%d before), %d open sockets (%d before)\n%s", n, goroutines, sockets(), socks, stacks)
		}
		return nil
	})
	n, _ := ours()
	t.Logf("after: %d goroutines (%d before, the NATS server's not counted), %d open sockets (%d before)", n, goroutines, sockets(), socks)
}
