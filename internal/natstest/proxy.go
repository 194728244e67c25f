package natstest

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy forwards TCP connections to a server. Cut closes every connection
// through it and refuses new ones for a while: a blip that the server and
// the client both notice at once (unlike a partition, which they notice
// only by their pings), after which the client reconnects.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	conns   map[net.Conn]bool
	refuse  time.Time // refuse connections until then
	stopped bool
}

// NewProxy listens on a random port of 127.0.0.1 and forwards to target
// (host:port); it stops on cleanup.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("natstest: proxy: %v", err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	go p.accept()
	t.Cleanup(p.stop)
	return p
}

// URL is the proxy's nats:// URL.
func (p *Proxy) URL() string { return "nats://" + p.ln.Addr().String() }

// Cut closes every connection through the proxy and refuses new ones for d.
func (p *Proxy) Cut(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = time.Now().Add(d)
	for c := range p.conns {
		c.Close()
	}
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.stopped || time.Now().Before(p.refuse)
		p.mu.Unlock()
		if refuse {
			c.Close()
			continue
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[s] = true, true
		p.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			dst.Close()
			src.Close()
			p.mu.Lock()
			delete(p.conns, dst)
			delete(p.conns, src)
			p.mu.Unlock()
		}
		go pipe(c, s)
		go pipe(s, c)
	}
}

func (p *Proxy) stop() {
	p.mu.Lock()
	p.stopped = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
}
