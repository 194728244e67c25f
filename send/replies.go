package send

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// replies routes the answers to the core requests of the clients of a
// connection, as nats.go's own request multiplexer does: one subscription
// on <inbox>.* for all of them (shared by every Client of the connection:
// repliesOf), and each request waiting on a channel under a token of its
// own. A request's reply subject is <inbox>.~<token>: marked unique
// (protocol.UniqueReplyMark), it is the request's key, so the request
// needs no Nats-Msg-Id header.
//
// It differs in what it costs a request (issue 14: with 64 callers, a
// Client's requests took 2.5 times the CPU of nc.Request's): its own mutex
// rather than the connection's, held only for a map insert and delete;
// the token a random number; the channel and the timer reused; and the call's
// bound a time, not a context made (and its timer started) per request.
type replies struct {
	nc *nats.Conn

	mu      sync.Mutex
	sub     *nats.Subscription // nil until the first request, and after the connection closed
	prefix  string             // "<inbox>.~": a token follows
	waiting map[uint64]chan *nats.Msg
	gone    chan struct{} // closed when sub ended: the connection closed
}

// muxes holds the replies of each connection that has one: made at a
// Client's first core request, forgotten when the connection closes (a
// Client made per call does not add a subscription each time).
var muxes sync.Map // *nats.Conn -> *replies

// repliesOf returns the replies of nc, made if it has none.
func repliesOf(nc *nats.Conn) *replies {
	if r, ok := muxes.Load(nc); ok {
		return r.(*replies)
	}
	r, _ := muxes.LoadOrStore(nc, &replies{nc: nc})
	return r.(*replies)
}

// errNoAnswer: a request's answer did not come before its bound.
var errNoAnswer = errors.New("no answer in time")

// answers are the channels requests wait on (capacity 1, empty). One is
// put back only by the request that received from it: a request that
// gave up may still be sent an answer on its channel.
var answers = sync.Pool{New: func() any { return make(chan *nats.Msg, 1) }}

// timers are stopped timers with nothing in their channel, reset for one
// wait each.
var timers sync.Pool

// request publishes m, its Reply the subject of token (0, or a token
// waited on by another request: a new random one), and waits for the
// answer until ctx ends (ctx.Err()) or until passes (errNoAnswer; a zero
// until: no bound but ctx). It returns the token it used: a request sent
// again gives it back, so that every attempt has one reply subject, its
// key (protocol.MessageKey), and an answer to any attempt ends the wait.
// The server's "no responders" status is nats.ErrNoResponders, and a
// connection closed meanwhile nats.ErrConnectionClosed. Nothing is sent
// when ctx has ended or until has passed already.
func (r *replies) request(ctx context.Context, m *nats.Msg, until time.Time, token uint64) (*nats.Msg, uint64, error) {
	if err := ctx.Err(); err != nil {
		return nil, token, err
	}
	var left time.Duration // until's, read once
	if !until.IsZero() {
		if left = time.Until(until); left <= 0 {
			return nil, token, errNoAnswer
		}
	}
	ch := answers.Get().(chan *nats.Msg)
	token, gone, err := r.expect(ch, token)
	if err != nil {
		answers.Put(ch)
		return nil, token, err
	}
	var digits [13]byte // the token's, without a string of their own
	m.Reply = r.prefix + string(strconv.AppendUint(digits[:0], token, 36))
	if err := r.nc.PublishMsg(m); err != nil {
		r.forget(token)
		return nil, token, err
	}
	var expired <-chan time.Time
	if !until.IsZero() {
		t, _ := timers.Get().(*time.Timer)
		if t == nil {
			t = time.NewTimer(left)
		} else {
			t.Reset(left)
		}
		defer func() {
			if !t.Stop() {
				// Expired: its tick was taken, unless a process run
				// with GODEBUG=asynctimerchan=1 (timers as before Go
				// 1.23) left it in the channel.
				select {
				case <-t.C:
				default:
				}
			}
			timers.Put(t)
		}()
		expired = t.C
	}
	select {
	case a := <-ch:
		answers.Put(ch)
		if len(a.Data) == 0 && a.Header.Get("Status") == "503" {
			return nil, token, nats.ErrNoResponders
		}
		return a, token, nil
	case <-expired:
		err = errNoAnswer
	case <-ctx.Done():
		err = ctx.Err()
	case <-gone:
		err = nats.ErrConnectionClosed
	}
	r.forget(token)
	return nil, token, err
}

// expect registers ch under token, or under a new one when token is 0 or
// taken, subscribing first if r has no subscription yet. It returns the
// token and the channel closed when the subscription ends.
func (r *replies) expect(ch chan *nats.Msg, token uint64) (uint64, <-chan struct{}, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sub == nil {
		if r.nc.IsClosed() {
			muxes.CompareAndDelete(r.nc, r)
			return 0, nil, nats.ErrConnectionClosed
		}
		inbox := r.nc.NewInbox()
		sub, err := r.nc.Subscribe(inbox+".*", r.deliver)
		if err != nil {
			return 0, nil, err
		}
		gone := make(chan struct{})
		sub.SetClosedHandler(func(string) { r.closed(gone) })
		r.sub, r.prefix, r.gone = sub, inbox+"."+protocol.UniqueReplyMark, gone
		if r.waiting == nil {
			r.waiting = map[uint64]chan *nats.Msg{}
		}
	}
	// A random token, as nats.go's own: whoever sees one reply subject
	// (a region serving the request) cannot tell the next one's, to
	// answer it before its entity does. math/rand/v2's source is ChaCha8,
	// seeded by the system.
	for token == 0 || r.waiting[token] != nil {
		token = rand.Uint64()
	}
	r.waiting[token] = ch
	return token, r.gone, nil
}

// forget drops token's channel: its request no longer waits.
func (r *replies) forget(token uint64) {
	r.mu.Lock()
	delete(r.waiting, token)
	r.mu.Unlock()
}

// deliver is the subscription's handler: the answer goes to the request
// waiting under the subject's token, if one still is.
func (r *replies) deliver(m *nats.Msg) {
	digits, ok := strings.CutPrefix(m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], protocol.UniqueReplyMark)
	if !ok {
		return
	}
	token, err := strconv.ParseUint(digits, 36, 64)
	if err != nil {
		return
	}
	r.mu.Lock()
	ch, ok := r.waiting[token]
	delete(r.waiting, token)
	r.mu.Unlock()
	if ok {
		ch <- m // never blocks: one answer per token, to an empty channel
	}
}

// closed runs when the subscription ended (the connection closed): the
// waiting requests return, the connection's replies are forgotten, and a
// later request fails (the connection being closed).
func (r *replies) closed(gone chan struct{}) {
	r.mu.Lock()
	if r.gone == gone {
		r.sub, r.gone = nil, nil
	}
	r.mu.Unlock()
	muxes.CompareAndDelete(r.nc, r)
	close(gone)
}
