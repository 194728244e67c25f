package sidecar

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"sync/atomic"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/protocol"
)

// entity is one entity of the app. The region calls it one message at a
// time, so each of its calls to the app ends before the next begins.
type entity struct {
	app   *App
	typ   string
	id    string
	shard int
	// applied is, in durable delivery, the stream sequence of the message
	// the entity's state applied last: read at activation, raised by the
	// state API's PUTs that carry HeaderSeq.
	applied atomic.Uint64
	durable bool
	env     *natshard.Env
}

// activate is the natshard.Factory of the app's types: it tells the app
// that entity id activates (POST /activate/{type}/{id}). An app that has
// no such callback (404 or 405) accepts every activation; another non-2xx
// answer, or no answer, fails the activation: the message that caused it
// gets the error, and the next message tries again.
func (a *App) activate(ctx context.Context, id string) (natshard.Entity, error) {
	env := natshard.EnvFrom(ctx)
	if env == nil {
		return nil, errors.New("sidecar: an entity outside a natshard node")
	}
	if env.Conn != nil {
		a.maxAnswer.Store(env.Conn.MaxPayload() - 4<<10)
	}
	e := &entity{app: a, typ: env.Type, id: id, shard: env.Shard, durable: env.Delivery == natshard.Durable, env: env}
	if e.durable {
		// Which message the state applied last: those at or below it are
		// not given to the app again.
		if ss, ok := env.Store.(natshard.SeqStore); ok {
			_, _, seq, err := ss.LoadEntitySeq(ctx, id)
			if err != nil && !errors.Is(err, natshard.ErrNotFound) {
				return nil, fmt.Errorf("sidecar: read the state of %q: %w", id, err)
			}
			e.applied.Store(seq)
		}
		a.mu.Lock()
		a.active[e.key()] = e
		a.mu.Unlock()
	}
	ans, err := a.call(ctx, e.path("activate"), nil, a.header(e.shard))
	if err != nil {
		return nil, err
	}
	if !ans.ok() && !ans.noCallback() {
		return nil, ans.err()
	}
	return e, nil
}

// Handle sends the message to the app (POST /entities/{type}/{id}): a 2xx
// answer's body is the reply; any other answer is the entity's error, with
// the answer's body. An answer with HeaderPassivate "true" passivates the
// entity (natshard.Env.Passivate).
func (e *entity) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	if m.Seq != 0 && m.Seq <= e.applied.Load() {
		return nil, nil // applied already: given again after a crash
	}
	h := e.app.header(e.shard)
	if m.Seq != 0 {
		h[HeaderSeq] = []string{strconv.FormatUint(m.Seq, 10)}
	}
	h[HeaderRequest] = []string{strconv.FormatBool(m.Reply != "")}
	if key := m.Key(); key != "" {
		h[HeaderMsgID] = []string{key}
	}
	if len(m.Header) > 0 {
		// A map of string slices always encodes.
		j, _ := json.Marshal(m.Header)
		h[HeaderHeaders] = []string{string(j)}
	}
	ans, err := e.app.call(ctx, e.path("entities"), m.Data, h)
	if err != nil {
		return nil, err
	}
	if ans.passivate {
		e.env.Passivate()
	}
	if !ans.ok() {
		return ans.body, ans.err()
	}
	return ans.body, nil
}

// Stop tells the app that the entity stops (POST /stop/{type}/{id}), on
// passivation, handoff and shutdown alike. A failure is returned, and
// logged by the region, which goes on. An app that is down is not asked.
func (e *entity) Stop(ctx context.Context) error {
	if e.durable {
		e.app.mu.Lock()
		if e.app.active[e.key()] == e {
			delete(e.app.active, e.key())
		}
		e.app.mu.Unlock()
	}
	select {
	case <-e.app.down:
		return nil // Run is leaving because of it; Down logged it once
	default:
	}
	ans, err := e.app.call(ctx, e.path("stop"), nil, e.app.header(e.shard))
	if err != nil {
		return err
	}
	if !ans.ok() && !ans.noCallback() {
		return ans.err()
	}
	return nil
}

func (e *entity) key() string { return e.typ + " " + e.id }

// path is the entity's path of a kind of call: /kind/{type}/{id}, the id
// escaped as a path segment.
func (e *entity) path(kind string) string {
	return "/" + kind + "/" + e.typ + "/" + url.PathEscape(e.id)
}

// header returns the headers of every call about an entity of shard.
func (a *App) header(shard int) http.Header {
	return http.Header{
		HeaderShard:    []string{strconv.Itoa(shard)},
		HeaderStateURL: []string{a.stateURL},
		"Content-Type": []string{"application/octet-stream"},
	}
}

// maxErrorText bounds the app's Natshard-Error text that goes into an
// error reply's header (and so into its NATS message).
const maxErrorText = 1024

// answer is what the app answered.
type answer struct {
	status int
	text   string // the status line: "500 Internal Server Error"
	msg    string // its Natshard-Error header
	code   string // its Natshard-Error-Code header, when a valid code
	body   []byte
	// passivate: its Natshard-Passivate header is "true"
	passivate bool
}

func (a answer) ok() bool { return a.status >= 200 && a.status < 300 }

// noCallback: the app does not implement the lifecycle callback it was
// asked.
func (a answer) noCallback() bool {
	return a.status == http.StatusNotFound || a.status == http.StatusMethodNotAllowed
}

// err is the entity's error for a non-2xx answer: its code is the app's
// (its Natshard-Error-Code header), or else http-<status>.
func (a answer) err() error {
	code := a.code
	if code == "" {
		code = "http-" + strconv.Itoa(a.status)
	}
	if a.msg != "" {
		return &appError{code: code, err: fmt.Errorf("app: answered %s: %s", a.text, a.msg)}
	}
	return &appError{code: code, err: fmt.Errorf("app: answered %s", a.text)}
}

// Codes of the errors of calls that got no answer of the app
// (docs/SIDECAR.md, "Errors"); an answer of the app has its own code, or
// http-<status>.
const (
	// CodeAppUnreachable: the app could not be reached, or did not
	// answer HTTP (refused, closed, garbage, cut short).
	CodeAppUnreachable = "app-unreachable"
	// CodeAppTimeout: no answer within the app timeout, or no call slot
	// free within it.
	CodeAppTimeout = "app-timeout"
	// CodeAppAnswerTooLarge: the app's answer does not fit in a NATS
	// message.
	CodeAppAnswerTooLarge = "app-answer-too-large"
)

// appError is an error of a call to the app with its code
// (protocol.ErrorCode reads it: the Natshard-Error-Code header).
type appError struct {
	code string
	err  error
}

func (e *appError) Error() string     { return e.err.Error() }
func (e *appError) ErrorCode() string { return e.code }
func (e *appError) Unwrap() error     { return e.err }

// call POSTs body to the app's path, within the timeout and a call slot,
// and reads the answer (at most maxAnswer bytes).
func (a *App) call(ctx context.Context, path string, body []byte, h http.Header) (answer, error) {
	cctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	select {
	case a.slots <- struct{}{}:
	case <-cctx.Done():
		if ctx.Err() != nil {
			return answer{}, a.callError(ctx, cctx, ctx.Err())
		}
		return answer{}, &appError{code: CodeAppTimeout, err: fmt.Errorf("app: no call slot free within %s: %d calls to the app in flight (app concurrency)", a.cfg.Timeout, cap(a.slots))}
	}
	defer func() { <-a.slots }()
	req, err := http.NewRequestWithContext(cctx, http.MethodPost, a.base+path, bytes.NewReader(body))
	if err != nil {
		return answer{}, fmt.Errorf("app: %w", err)
	}
	req.Header = h
	resp, err := a.client.Do(req)
	if err != nil {
		return answer{}, a.callError(ctx, cctx, err)
	}
	defer resp.Body.Close()
	limit := a.maxAnswer.Load()
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	switch {
	case err != nil:
		return answer{}, a.callError(ctx, cctx, fmt.Errorf("its answer was cut short: %w", err))
	case int64(len(data)) > limit:
		return answer{}, &appError{code: CodeAppAnswerTooLarge, err: fmt.Errorf("app: its answer to %s is larger than %d bytes, the most a NATS message holds here", path, limit)}
	}
	msg := resp.Header.Get(HeaderError)
	if len(msg) > maxErrorText {
		msg = msg[:maxErrorText] + "..."
	}
	code := resp.Header.Get(HeaderErrorCode)
	if !protocol.ValidErrorCode(code) {
		code = ""
	}
	return answer{status: resp.StatusCode, text: resp.Status, msg: msg, code: code, body: data, passivate: resp.Header.Get(HeaderPassivate) == "true"}, nil
}

// callError says why a call failed: it was cancelled (ctx, the entity's,
// ended: its shard left this process, or the node closed), it timed out
// (cctx), or the app could not be reached or answered garbage.
func (a *App) callError(ctx, cctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("app: call cancelled: %w", ctx.Err())
	case cctx.Err() != nil:
		return &appError{code: CodeAppTimeout, err: fmt.Errorf("app: no answer within %s (app timeout)", a.cfg.Timeout)}
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	if errors.Is(err, io.EOF) {
		return &appError{code: CodeAppUnreachable, err: fmt.Errorf("app: closed the connection without answering: %w", err)}
	}
	return &appError{code: CodeAppUnreachable, err: fmt.Errorf("app: %w", err)}
}
