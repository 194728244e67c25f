package sidecar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/natshard/natshard"
)

// Kind is the entity kind of the types whose entities live in an app,
// stored with the type (shardd --kind http).
const Kind = "http"

// Defaults of Config.
const (
	DefaultConcurrency    = 64
	DefaultTimeout        = 5 * time.Second
	DefaultHealthInterval = time.Second
	DefaultDownAfter      = 10 * time.Second
	DefaultStateListen    = "127.0.0.1:0"
	// HealthPath is asked with GET: the app is ready when it answers 2xx.
	HealthPath = "/healthz"
)

// Headers of the calls to the app (see docs/SIDECAR.md).
const (
	HeaderShard    = "Natshard-Shard"     // the entity's shard
	HeaderMsgID    = "Natshard-Msg-Id"    // the message's key (Message.Key), when it has one
	HeaderRequest  = "Natshard-Request"   // "true": a requester waits for the answer; "false": a publish
	HeaderHeaders  = "Natshard-Headers"   // the message's NATS headers, as a JSON object of arrays
	HeaderStateURL = "Natshard-State-Url" // the state API's base URL
	// HeaderSeq, in durable delivery: the message's stream sequence. The
	// app passes it back on the PUT of the state that applies the
	// message; the state is then stored with it, and the sidecar does not
	// call the app again for a message at or below it (given again after
	// a crash). On a GET of the state, the sequence it applied last.
	HeaderSeq = "Natshard-Seq"
	// HeaderError, on a non-2xx answer of the app, is the error text the
	// requester gets (by default "app: answered <status>").
	HeaderError = "Natshard-Error"
	// HeaderErrorCode, on a non-2xx answer of the app, is the error's
	// code (1 to 64 of [A-Za-z0-9-_.:]), passed on to the requester in
	// the same NATS header (by default http-<status>).
	HeaderErrorCode = "Natshard-Error-Code"
	// HeaderPassivate "true" on the app's answer to a message: the entity
	// is done; it stops now (its stop call comes; a message after it
	// activates it again), and a type that remembers its entities
	// forgets it.
	HeaderPassivate = "Natshard-Passivate"
)

// idleConnTimeout closes connections to the app idle this long: less than
// Node.js's default keep-alive timeout (5 s), so that a call is not sent
// on a connection that the app is closing at that moment.
const idleConnTimeout = 4 * time.Second

// Errors of an App.
var (
	// ErrAppDown: the app failed its health checks for Config.DownAfter;
	// Run then left the cluster.
	ErrAppDown = errors.New("sidecar: the app is down")
	// ErrClosed: the App was closed.
	ErrClosed = errors.New("sidecar: closed")
)

// Config configures an App. A zero field means its default.
type Config struct {
	// App is the app's base URL, http:// or https://; its path, if any,
	// prefixes every path of the contract. Required.
	App string
	// Concurrency bounds the calls in flight to the app (and the
	// connections to it); a call waits for a free slot within its
	// Timeout. DefaultConcurrency.
	Concurrency int
	// Timeout bounds each call to the app (waiting for a slot included),
	// each health check and each state API request. DefaultTimeout.
	Timeout time.Duration
	// HealthInterval between health checks once the node runs.
	// DefaultHealthInterval.
	HealthInterval time.Duration
	// DownAfter: an app that fails every health check for this long is
	// down (Down, ErrAppDown). DefaultDownAfter.
	DownAfter time.Duration
	// StateListen is the state API's address: a loopback address, since
	// the API has no authentication; port 0 picks a free port, which the
	// app learns from the Natshard-State-Url header of every call.
	// DefaultStateListen.
	StateListen string
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Started, if set, is called by Run with the node once it started
	// (after the app answered): shardd gives it to its web.Handler.
	Started func(*natshard.Node)
}

// withDefaults returns c with its zero fields set to the defaults.
func (c Config) withDefaults() Config {
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.HealthInterval == 0 {
		c.HealthInterval = DefaultHealthInterval
	}
	if c.DownAfter == 0 {
		c.DownAfter = DefaultDownAfter
	}
	if c.StateListen == "" {
		c.StateListen = DefaultStateListen
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// validate checks c (with defaults) and returns the app's URL. Its errors
// say what is wrong in words that fit the Config fields and shardd's
// flags alike.
func (c Config) validate() (*url.URL, error) {
	var errs []error
	app, err := url.Parse(c.App)
	switch {
	case c.App == "":
		errs = append(errs, errors.New("no app URL given (like http://127.0.0.1:8080)"))
	case err != nil:
		errs = append(errs, fmt.Errorf("the app URL %q is not an http:// or https:// URL (like http://127.0.0.1:8080): %w", c.App, err))
	case app.Scheme != "http" && app.Scheme != "https" || app.Host == "":
		errs = append(errs, fmt.Errorf("the app URL %q is not an http:// or https:// URL (like http://127.0.0.1:8080)", c.App))
	case app.User != nil || app.RawQuery != "" || app.Fragment != "":
		errs = append(errs, fmt.Errorf("the app URL %q has a user, a query or a fragment; give its scheme, host, port and path only", c.App))
	}
	if c.Concurrency < 1 {
		errs = append(errs, fmt.Errorf("the app concurrency %d is less than 1", c.Concurrency))
	}
	if c.Timeout < 0 || c.HealthInterval < 0 || c.DownAfter < 0 {
		errs = append(errs, fmt.Errorf("negative app timeout (%s), health interval (%s) or down-after time (%s)", c.Timeout, c.HealthInterval, c.DownAfter))
	}
	if host, _, err := net.SplitHostPort(c.StateListen); err != nil {
		errs = append(errs, fmt.Errorf("the state API address %q is not host:port: %w", c.StateListen, err))
	} else if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		errs = append(errs, fmt.Errorf("the state API address %q is not a loopback address: the state API has no authentication, so it listens on 127.0.0.1, ::1 or localhost only", c.StateListen))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("sidecar: %w", err)
	}
	app.Path = strings.TrimSuffix(app.Path, "/")
	app.RawPath = strings.TrimSuffix(app.RawPath, "/")
	return app, nil
}

// App is an HTTP application that hosts the entities of natshard types,
// seen from the node that hosts their regions: each message to an entity
// is a call to the app, which is also told when an entity activates and
// stops, and which reads and writes the entities' state through the state
// API that the App serves. See the package documentation for the order in
// which to use it, and docs/SIDECAR.md for the contract.
//
// Its methods are safe for concurrent use.
type App struct {
	cfg      Config
	log      *slog.Logger
	base     string // the app's URL, without a trailing slash
	stateURL string // the state API's, http://host:port

	client *http.Client // calls, at most cfg.Concurrency at once
	health *http.Client // health checks, on their own connection
	slots  chan struct{}
	// maxAnswer is the largest answer (and state) in bytes: the NATS
	// connection's max payload less room for headers, set at activations.
	maxAnswer atomic.Int64

	state *http.Server
	ln    net.Listener

	mu       sync.Mutex
	types    map[string]bool    // types given to Type: the state API serves them
	active   map[string]*entity // "<type> <id>" -> active entity (durable delivery)
	node     *natshard.Node     // set by Attach
	attached chan struct{}      // closed by Attach

	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // the state server and the health monitor

	down     chan struct{} // closed when the app is found down
	downOnce sync.Once
	downErr  error
	closed   atomic.Bool
}

// New checks cfg and returns an App; it listens on the state API's
// address at once (so the address is known before the first call), and
// the API answers once Attach gave it a node. Close it after the node
// stopped.
func New(cfg Config) (*App, error) {
	cfg = cfg.withDefaults()
	app, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.StateListen)
	if err != nil {
		return nil, fmt.Errorf("sidecar: the state API cannot listen on %s: %w", cfg.StateListen, err)
	}
	a := &App{
		cfg:      cfg,
		log:      cfg.Logger,
		base:     app.String(),
		stateURL: "http://" + ln.Addr().String(),
		client:   newClient(cfg.Concurrency, cfg.Timeout),
		health:   newClient(1, cfg.Timeout),
		slots:    make(chan struct{}, cfg.Concurrency),
		ln:       ln,
		types:    map[string]bool{},
		active:   map[string]*entity{},
		attached: make(chan struct{}),
		down:     make(chan struct{}),
	}
	a.maxAnswer.Store(1<<20 - 4<<10) // NATS's default max payload, until a connection says
	a.ctx, a.cancel = context.WithCancel(context.Background())
	a.state = &http.Server{
		Handler:           a.stateHandler(),
		ReadHeaderTimeout: cfg.Timeout,
		IdleTimeout:       time.Minute,
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn),
	}
	a.wg.Go(func() {
		if err := a.state.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("sidecar: the state API stopped", "err", err)
		}
	})
	a.log.Info("sidecar: state API listening", "url", a.stateURL, "app", a.base, "concurrency", cfg.Concurrency, "timeout", cfg.Timeout.String())
	return a, nil
}

// newClient returns a client whose transport keeps up to conns
// connections to the app alive and opens no more. It ignores proxy
// settings (the app is local) and follows no redirect: a 3xx is an
// error like any other non-2xx answer.
func newClient(conns int, timeout time.Duration) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			DialContext:            (&net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:           conns,
			MaxIdleConnsPerHost:    conns,
			MaxConnsPerHost:        conns,
			IdleConnTimeout:        idleConnTimeout,
			TLSHandshakeTimeout:    timeout,
			DisableCompression:     true,
			MaxResponseHeaderBytes: 64 << 10,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

// StateURL is the state API's base URL (http://127.0.0.1:port).
func (a *App) StateURL() string { return a.stateURL }

// Type returns t hosted by the app: its entities are the app's, its Kind
// is Kind unless t names one, and the state API serves its state. Give
// the result to natshard.Start.
func (a *App) Type(t natshard.Type) natshard.Type {
	if t.Kind == "" {
		t.Kind = Kind
	}
	t.Entity = a.activate
	a.mu.Lock()
	a.types[t.Name] = true
	a.mu.Unlock()
	return t
}

// Attach gives the App the node that hosts its types, once natshard.Start
// returned: the state API serves their state from then on, and the App
// checks the app's health every HealthInterval (Down). Call it once.
func (a *App) Attach(node *natshard.Node) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.node != nil {
		return
	}
	a.node = node
	close(a.attached)
	a.wg.Go(a.monitor)
}

// Down is closed when the app has failed its health checks for DownAfter
// (Err says how); the node should then leave (Run does).
func (a *App) Down() <-chan struct{} { return a.down }

// Err is nil until the app is down, then an error wrapping ErrAppDown.
func (a *App) Err() error {
	select {
	case <-a.down:
		return a.downErr
	default:
		return nil
	}
}

// Close stops the state API and the health checks and closes the idle
// connections to the app. Call it after the node stopped: entities that
// stop call the app, which may flush state through the state API. It
// returns ErrClosed when the App was closed already.
func (a *App) Close() error {
	if a.closed.Swap(true) {
		return ErrClosed
	}
	a.cancel()
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.Timeout)
	defer cancel()
	err := a.state.Shutdown(ctx)
	if err != nil {
		err = errors.Join(err, a.state.Close())
	}
	a.wg.Wait()
	a.client.CloseIdleConnections()
	a.health.CloseIdleConnections()
	if err != nil {
		return fmt.Errorf("sidecar: close the state API: %w", err)
	}
	return nil
}

// Run hosts types in the app until ctx ends, the node fails, or the app is
// down: it starts the state API (New), waits until the app answers its
// health check (WaitReady), only then starts a node with opts, which
// registers its regions (natshard.Start), serves the state API from it
// (Attach), and at the end stops the node gracefully (its shards are
// handed off, for at most natshard.LeaveTimeout) and closes the App. The
// types' Entity is the app's (Type). cfg.Logger defaults to opts.Logger.
//
// It returns nil after a stop, Start's error, why the node failed, or,
// when the app stayed down, an error wrapping ErrAppDown: the process
// left the cluster so that the processes whose app answers serve its
// shards, and a restarted one registers again once its app answers.
func Run(ctx context.Context, opts natshard.Options, cfg Config, types ...natshard.Type) error {
	if cfg.Logger == nil {
		cfg.Logger = opts.Logger
	}
	a, err := New(cfg)
	if err != nil {
		return err
	}
	defer a.Close()
	if err := a.WaitReady(ctx); err != nil {
		if ctx.Err() != nil {
			a.log.Info("sidecar: stopped before the app was ready")
			return nil
		}
		return err
	}
	hosted := make([]natshard.Type, len(types))
	for i, t := range types {
		hosted[i] = a.Type(t)
	}
	node, err := natshard.Start(ctx, opts, hosted...)
	if err != nil {
		return err
	}
	a.Attach(node)
	if cfg.Started != nil {
		cfg.Started(node)
	}
	select {
	case <-ctx.Done():
	case <-node.Done():
	case <-a.Down():
		a.log.Error("sidecar: the app is down: leaving, so that the other processes serve this one's shards", "err", a.Err())
	}
	sctx, cancel := context.WithTimeout(context.Background(), natshard.LeaveTimeout)
	defer cancel()
	if err := node.Stop(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		a.log.Warn("sidecar: stop", "err", err)
	}
	if err := node.Err(); err != nil {
		return err
	}
	return a.Err()
}
