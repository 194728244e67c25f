package natstest

import (
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
	frozen  chan struct{} // closed by Thaw; nil: not frozen
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

// Freeze stops forwarding, in both directions, without closing anything,
// until Thaw: to the server and to the client, the other side looks like
// a process that was stopped (SIGSTOP, a long GC pause, a VM stall). What
// either side sends meanwhile waits, in order, in the proxy and the
// sockets' buffers. Keep a freeze shorter than the server's and the
// client's ping timeouts, or they close the connection.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.frozen == nil {
		p.frozen = make(chan struct{})
	}
}

// Thaw forwards again what waited since Freeze, and the rest.
func (p *Proxy) Thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.frozen != nil {
		close(p.frozen)
		p.frozen = nil
	}
}

// thawed waits while the proxy is frozen.
func (p *Proxy) thawed() {
	p.mu.Lock()
	frozen := p.frozen
	p.mu.Unlock()
	if frozen != nil {
		<-frozen
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
			buf := make([]byte, 32<<10)
			for {
				n, err := src.Read(buf)
				if n > 0 {
					p.thawed()
					if _, err := dst.Write(buf[:n]); err != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
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
	p.Thaw()
	p.mu.Lock()
	p.stopped = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
}
