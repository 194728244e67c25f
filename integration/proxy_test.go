package integration

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// gate says whether the proxies it guards forward bytes. Shut, they stop
// forwarding both ways and keep every connection open (a black hole, as
// when a cable is pulled): what they read meanwhile is held, not dropped,
// and delivered once the gate opens (TCP's retransmission after the
// cable is back), and a connection that ends while shut ends at the
// opening.
type gate struct {
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

func newGate() *gate {
	g := &gate{open: make(chan struct{})}
	close(g.open)
	return g
}

// shut stops the forwarding; open resumes it.
func (g *gate) shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default:
	}
}

func (g *gate) reopen() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

// wait returns true once the gate is open, false if done closes first.
func (g *gate) wait(done <-chan struct{}) bool {
	g.mu.Lock()
	open := g.open
	g.mu.Unlock()
	select {
	case <-open:
		return true
	case <-done:
		return false
	}
}

// proxy forwards the TCP connections made to its address to target,
// through gate g.
type proxy struct {
	ln     net.Listener
	target string
	g      *gate
	done   chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]bool
}

// startProxy listens on a free port of 127.0.0.1; it is closed, with its
// connections, when the test ends.
func startProxy(t *testing.T, target string, g *gate) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target, g: g, done: make(chan struct{}), conns: map[net.Conn]bool{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) port() int { return p.ln.Addr().(*net.TCPAddr).Port }

func (p *proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			return
		}
		p.wg.Go(func() { p.serve(c) })
	}
}

// track records c to close it with the proxy; false if it is closed.
func (p *proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.done:
		c.Close()
		return false
	default:
	}
	p.conns[c] = true
	return true
}

func (p *proxy) untrack(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
	c.Close()
}

func (p *proxy) serve(c net.Conn) {
	defer p.untrack(c)
	// A connection made while the gate is shut reaches nobody until it
	// opens (a SYN into a pulled cable).
	if !p.g.wait(p.done) {
		return
	}
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	if !p.track(up) {
		return
	}
	defer p.untrack(up)
	var wg sync.WaitGroup
	wg.Go(func() { p.pipe(up, c) })
	wg.Go(func() { p.pipe(c, up) })
	wg.Wait()
}

// pipe copies src to dst through the gate; at src's end (once the gate
// lets it through) it closes both.
func (p *proxy) pipe(dst, src net.Conn) {
	defer func() {
		dst.Close()
		src.Close()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.g.wait(p.done) {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil { // the end, a reset or a close
			p.g.wait(p.done)
			return
		}
	}
}

func (p *proxy) close() {
	p.mu.Lock()
	select {
	case <-p.done:
	default:
		close(p.done)
	}
	p.ln.Close()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// TestProxyGate: bytes pass an open gate, are held by a shut one without
// closing the connection, and arrive once it opens again.
func TestProxyGate(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // an echo server
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	g := newGate()
	p := startProxy(t, ln.Addr().String(), g)
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", p.port()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	echo := func(line string, wait time.Duration) (string, error) {
		if _, err := c.Write([]byte(line + "\n")); err != nil {
			return "", err
		}
		_ = c.SetReadDeadline(time.Now().Add(wait))
		return r.ReadString('\n')
	}
	if got, err := echo("one", 5*time.Second); err != nil || got != "one\n" {
		t.Fatalf("through an open gate: %q, %v", got, err)
	}
	g.shut()
	if got, err := echo("two", 300*time.Millisecond); err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("through a shut gate: %q, %v (want a timeout)", got, err)
	}
	g.reopen()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if got, err := r.ReadString('\n'); err != nil || got != "two\n" {
		t.Fatalf("held across the shut gate: %q, %v", got, err)
	}
}
