package sidecar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/natshard/natshard/internal/wait"
)

// readyPoll is the pause between two health checks while WaitReady waits,
// readyLog the one between two log lines saying that it still waits.
const (
	readyPoll = 200 * time.Millisecond
	readyLog  = 5 * time.Second
)

// WaitReady returns once the app answers its health check (GET /healthz,
// 2xx), or with an error when ctx ends first. It logs what it waits for
// at once and every 5 s, with the last check's error: a misconfigured or
// unreachable app shows in the log. Start the node after it (Run does),
// so that no shard is allocated to a process whose app cannot serve it.
func (a *App) WaitReady(ctx context.Context) error {
	var logged time.Time
	for {
		err := a.check(ctx)
		if err == nil {
			a.log.Info("sidecar: the app answers its health check", "url", a.base+HealthPath)
			return nil
		}
		if time.Since(logged) >= readyLog {
			a.log.Warn("sidecar: waiting for the app to answer its health check", "url", a.base+HealthPath, "err", err)
			logged = time.Now()
		}
		if !wait.Sleep(ctx, readyPoll) {
			return fmt.Errorf("sidecar: the app at %s did not answer its health check: %w (last: %v)", a.base, ctx.Err(), err)
		}
	}
}

// check asks the app's health check once, within the timeout.
func (a *App) check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.base+HealthPath, nil)
	if err != nil {
		return err
	}
	req.Header.Set(HeaderStateURL, a.stateURL)
	resp, err := a.health.Do(req)
	if err != nil {
		var ue *url.Error
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("no answer within %s", a.cfg.Timeout)
		case errors.As(err, &ue):
			return ue.Err // without the method and URL, which the caller names
		}
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		return fmt.Errorf("answered %s", resp.Status)
	}
	return nil
}

// monitor checks the app's health every HealthInterval until Close; when
// every check failed for DownAfter, the app is down.
func (a *App) monitor() {
	t := time.NewTicker(a.cfg.HealthInterval)
	defer t.Stop()
	var failing time.Time // since when every check failed; zero while it answers
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
		err := a.check(a.ctx)
		switch {
		case a.ctx.Err() != nil:
			return
		case err == nil && !failing.IsZero():
			a.log.Info("sidecar: the app answers its health check again", "failed_for", time.Since(failing).Round(time.Millisecond).String())
			failing = time.Time{}
		case err == nil:
		case failing.IsZero():
			a.log.Warn("sidecar: the app failed its health check", "url", a.base+HealthPath, "err", err,
				"down_after", a.cfg.DownAfter.String())
			failing = time.Now()
		case time.Since(failing) >= a.cfg.DownAfter:
			a.downOnce.Do(func() {
				a.downErr = fmt.Errorf("%w: %s failed every health check for %s (last: %v)", ErrAppDown, a.base+HealthPath, a.cfg.DownAfter, err)
				close(a.down)
			})
			return
		}
	}
}
