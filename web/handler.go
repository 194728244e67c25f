package web

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/protocol"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Options configure a Handler.
type Options struct {
	// Gatherer serves /metrics (the registry given to
	// natshard.Options.Metrics, with whatever else it holds); nil serves
	// no /metrics.
	Gatherer prometheus.Gatherer
	// NoUI serves no /ui: metrics and health only.
	NoUI bool
	// Logger gets the handler's errors; nil means slog.Default().
	Logger *slog.Logger
}

// Handler serves a node's /metrics, /healthz, /readyz and /ui. It is safe
// for concurrent use. Create it with New.
type Handler struct {
	opts Options
	log  *slog.Logger
	mux  *http.ServeMux
	node atomic.Pointer[natshard.Node]
	wait atomic.Pointer[natshard.StartWait] // what Start waits for, until SetNode
}

// Timeouts of what the UI asks over NATS.
const (
	statusTimeout = 2 * time.Second // the coordinator's status
	queryTimeout  = time.Second     // each region's query
	entityLimit   = 200             // entity ids of a region's detail
	keepAlive     = 15 * time.Second
)

//go:embed ui
var uiFiles embed.FS

// New returns a handler for node, which may be nil until SetNode: until
// then /healthz and /readyz answer 503 "starting" and the UI's data calls
// fail, so that a process can listen before its node has connected and
// registered (shardd does).
func New(node *natshard.Node, opts Options) *Handler {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	h := &Handler{opts: opts, log: opts.Logger, mux: http.NewServeMux()}
	if node != nil {
		h.node.Store(node)
	}
	h.mux.HandleFunc("GET /{$}", h.index)
	h.mux.HandleFunc("GET /healthz", h.healthz)
	h.mux.HandleFunc("GET /readyz", h.readyz)
	if opts.Gatherer != nil {
		h.mux.Handle("GET /metrics", promhttp.HandlerFor(opts.Gatherer, promhttp.HandlerOpts{
			ErrorLog: slog.NewLogLogger(h.log.Handler(), slog.LevelWarn), ErrorHandling: promhttp.ContinueOnError,
		}))
	}
	if !opts.NoUI {
		static, _ := fs.Sub(uiFiles, "ui")
		h.mux.Handle("GET /ui/", http.StripPrefix("/ui/", http.FileServerFS(static)))
		h.mux.Handle("GET /ui", http.RedirectHandler("/ui/", http.StatusFound))
		h.mux.HandleFunc("GET /ui/api/types", h.apiTypes)
		h.mux.HandleFunc("GET /ui/api/status", h.apiStatus)
		h.mux.HandleFunc("GET /ui/api/regions", h.apiRegions)
		h.mux.HandleFunc("GET /ui/api/region", h.apiRegion)
		h.mux.HandleFunc("GET /ui/api/events", h.apiEvents)
	}
	return h
}

// SetNode gives the handler its node once it started.
func (h *Handler) SetNode(n *natshard.Node) { h.node.Store(n) }

// SetStartWait tells the handler what natshard.Start waits for before
// SetNode: pass it as natshard.Options.OnStartWait. While Start waits for
// JetStream, /readyz answers 503 saying what for and /healthz 200 (the
// process is alive and connected, and Start gives up by itself after
// Options.StartTimeout), so that a liveness probe does not restart a
// process that only waits for its cluster.
func (h *Handler) SetStartWait(w natshard.StartWait) {
	if !w.Waiting() {
		h.wait.Store(nil)
		return
	}
	h.wait.Store(&w)
}

// startErr is why a node that has not started is not ready, and whether
// it is alive.
func (h *Handler) startErr() (err error, alive bool) {
	if w := h.wait.Load(); w != nil {
		return fmt.Errorf("starting: %s", w), true
	}
	return errStarting, false
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

func (h *Handler) index(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "natshard")
	fmt.Fprintln(w, "  /healthz   alive: the node serves and its NATS connection is up")
	fmt.Fprintln(w, "  /readyz    ready: every type's region registered, taken in by a coordinator, done replaying")
	if h.opts.Gatherer != nil {
		fmt.Fprintln(w, "  /metrics   Prometheus metrics")
	}
	if !h.opts.NoUI {
		fmt.Fprintln(w, "  /ui/       the live shard map")
	}
}

// errStarting: the node has not started (SetNode was not called).
var errStarting = errors.New("starting: not connected and registered yet")

func (h *Handler) healthz(w http.ResponseWriter, _ *http.Request) {
	n := h.node.Load()
	if n == nil {
		err, alive := h.startErr()
		if alive {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.Header().Set("Cache-Control", "no-store")
			fmt.Fprintf(w, "ok (%s)\n", err)
			return
		}
		probeAnswer(w, err)
		return
	}
	probeAnswer(w, n.Healthy())
}

func (h *Handler) readyz(w http.ResponseWriter, _ *http.Request) {
	n := h.node.Load()
	if n == nil {
		err, _ := h.startErr()
		probeAnswer(w, err)
		return
	}
	probeAnswer(w, n.Ready())
}

// probeAnswer answers a health probe: 200 "ok", or 503 and why.
func probeAnswer(w http.ResponseWriter, err error) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, err)
		return
	}
	fmt.Fprintln(w, "ok")
}

// ---- the UI's data ----

type typesAnswer struct {
	Region string   `json:"region"` // the node's region id
	Types  []string `json:"types"`
}

func (h *Handler) apiTypes(w http.ResponseWriter, _ *http.Request) {
	n := h.node.Load()
	if n == nil {
		writeJSON(w, http.StatusServiceUnavailable, protocol.AdminError{Error: errStarting.Error()})
		return
	}
	writeJSON(w, http.StatusOK, typesAnswer{Region: n.Region(), Types: n.Types()})
}

// subjects returns the node and the subjects of the request's type
// parameter, which must be one of the node's types; otherwise it answers
// the error itself and returns false.
func (h *Handler) subjects(w http.ResponseWriter, r *http.Request) (*natshard.Node, protocol.Subjects, bool) {
	n := h.node.Load()
	if n == nil {
		writeJSON(w, http.StatusServiceUnavailable, protocol.AdminError{Error: errStarting.Error()})
		return nil, protocol.Subjects{}, false
	}
	typ := r.URL.Query().Get("type")
	if !slices.Contains(n.Types(), typ) {
		writeJSON(w, http.StatusBadRequest, protocol.AdminError{Error: fmt.Sprintf("type %q is not hosted here (types: %v)", typ, n.Types())})
		return nil, protocol.Subjects{}, false
	}
	o := n.Options()
	s, err := protocol.NewSubjects(o.DataPrefix, o.ControlPrefix, typ)
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, protocol.AdminError{Error: err.Error()})
		return nil, protocol.Subjects{}, false
	}
	return n, s, true
}

// status asks the coordinator for the table.
func status(ctx context.Context, nc *nats.Conn, s protocol.Subjects) (protocol.Status, error) {
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	m, err := nc.RequestWithContext(ctx, s.Admin(protocol.AdminStatus), nil)
	if errors.Is(err, nats.ErrNoResponders) {
		return protocol.Status{}, errors.New("no coordinator answers (a failover takes up to a lease TTL)")
	}
	if err != nil {
		return protocol.Status{}, fmt.Errorf("the coordinator's status: %w", err)
	}
	var st struct {
		protocol.Status
		Error string `json:"error"`
	}
	if err := json.Unmarshal(m.Data, &st); err != nil {
		return protocol.Status{}, fmt.Errorf("the coordinator's status: %w", err)
	}
	if st.Error != "" {
		return protocol.Status{}, errors.New(st.Error)
	}
	return st.Status, nil
}

func (h *Handler) apiStatus(w http.ResponseWriter, r *http.Request) {
	n, s, ok := h.subjects(w, r)
	if !ok {
		return
	}
	st, err := status(r.Context(), n.Conn(), s)
	if err != nil {
		writeJSON(w, http.StatusBadGateway, protocol.AdminError{Error: err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, st)
}

// regionAnswer is what one region answered to a query, or why not.
type regionAnswer struct {
	Region string                `json:"region"`
	Answer *protocol.QueryAnswer `json:"answer,omitempty"`
	Error  string                `json:"error,omitempty"`
}

// query asks region id a query.
func query(ctx context.Context, nc *nats.Conn, s protocol.Subjects, id string, req protocol.QueryRequest) regionAnswer {
	ra := regionAnswer{Region: id}
	body, _ := json.Marshal(req)
	ctx, cancel := context.WithTimeout(ctx, queryTimeout)
	defer cancel()
	m, err := nc.RequestWithContext(ctx, s.Query(id), body)
	if err != nil {
		ra.Error = err.Error()
		return ra
	}
	var ans struct {
		protocol.QueryAnswer
		Error string `json:"error"`
	}
	switch err := json.Unmarshal(m.Data, &ans); {
	case err != nil:
		ra.Error = err.Error()
	case ans.Error != "":
		ra.Error = ans.Error
	default:
		ra.Answer = &ans.QueryAnswer
	}
	return ra
}

// apiRegions asks every registered region (as the coordinator lists
// them) for its shards' entities and rates, at once.
func (h *Handler) apiRegions(w http.ResponseWriter, r *http.Request) {
	n, s, ok := h.subjects(w, r)
	if !ok {
		return
	}
	st, err := status(r.Context(), n.Conn(), s)
	if err != nil {
		writeJSON(w, http.StatusBadGateway, protocol.AdminError{Error: err.Error()})
		return
	}
	out := make([]regionAnswer, len(st.Regions))
	var wg sync.WaitGroup
	for i, reg := range st.Regions {
		wg.Go(func() { out[i] = query(r.Context(), n.Conn(), s, reg.ID, protocol.QueryRequest{}) })
	}
	wg.Wait()
	writeJSON(w, http.StatusOK, map[string]any{"regions": out})
}

// apiRegion asks one region for its detail, with entity ids.
func (h *Handler) apiRegion(w http.ResponseWriter, r *http.Request) {
	n, s, ok := h.subjects(w, r)
	if !ok {
		return
	}
	id := r.URL.Query().Get("id")
	if err := protocol.ValidateName("region id", id); err != nil {
		writeJSON(w, http.StatusBadRequest, protocol.AdminError{Error: err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, query(r.Context(), n.Conn(), s, id, protocol.QueryRequest{Entities: true, Limit: entityLimit}))
}

// apiEvents streams the type's events (the coordinator's, as published)
// to the page as server-sent events, until the client goes, the node
// stops or a slow client lets its queue fill (it reconnects).
func (h *Handler) apiEvents(w http.ResponseWriter, r *http.Request) {
	n, s, ok := h.subjects(w, r)
	if !ok {
		return
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	events := make(chan *nats.Msg, 256)
	sub, err := n.Conn().ChanSubscribe(s.Events(), events)
	if err != nil {
		writeJSON(w, http.StatusBadGateway, protocol.AdminError{Error: fmt.Sprintf("subscribe to the events: %v", err)})
		return
	}
	defer sub.Unsubscribe()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Accel-Buffering", "no")
	fmt.Fprint(w, "retry: 1000\n: natshard events of "+s.Type()+"\n\n")
	flusher.Flush()
	ping := time.NewTicker(keepAlive)
	defer ping.Stop()
	for {
		select {
		case <-r.Context().Done():
			return
		case <-n.Done():
			return
		case <-ping.C:
			fmt.Fprint(w, ": keep-alive\n\n")
		case m := <-events:
			// Forwarded as published (one compact JSON object), on one
			// line; anything else is dropped. The page treats its fields
			// as untrusted text.
			var v map[string]any
			data := bytes.TrimSpace(m.Data)
			if json.Unmarshal(data, &v) != nil || bytes.ContainsAny(data, "\r\n") {
				continue
			}
			fmt.Fprintf(w, "data: %s\n\n", data)
		}
		flusher.Flush()
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
