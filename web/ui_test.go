package web_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/web"
)

// browser finds a Chromium or Chrome to drive: $NATSHARD_CHROME, or one
// of the usual names on $PATH (Debian's package is chromium).
func browser() (string, error) {
	if p := os.Getenv("NATSHARD_CHROME"); p != "" {
		return exec.LookPath(p)
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless-shell"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("none of chromium, chromium-browser, google-chrome, google-chrome-stable, headless-shell is on $PATH, and $NATSHARD_CHROME is not set")
}

// logDir is where tests keep files for people to look at:
// $NATSHARD_TEST_LOGS, or natshard-test-logs in the temporary directory.
func logDir(t *testing.T) string {
	dir := os.Getenv("NATSHARD_TEST_LOGS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "natshard-test-logs")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestShardMapInABrowser loads /ui/ in a headless Chromium: the page shows
// every shard of the type, in the row of its region, follows an operator's
// move as its events arrive (the time it took is reported, not asserted),
// shows a region's detail on a click, and is kept as a screenshot.
func TestShardMapInABrowser(t *testing.T) {
	path, err := browser()
	if err != nil {
		// .ci/run sets NATSHARD_REQUIRE_BROWSER=1 where it finds
		// Chromium: there, not finding one is a failure.
		skip := t.Skipf
		if os.Getenv("NATSHARD_REQUIRE_BROWSER") != "" {
			skip = t.Fatalf
		}
		skip("no browser to drive, skipping the shard map's browser test (apt-get install chromium; .ci/run installs it): %v", err)
	}
	const shards = 16
	url := natstest.URL(natstest.RunServer(t))
	ctx := context.Background()
	start := func(region string) *natshard.Node {
		n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: region, Logger: quiet},
			natshard.Type{Name: "map", Shards: shards, MinRegions: 2, RebalanceInterval: natshard.Off, Entity: newEcho})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(ctx) })
		return n
	}
	a, b := start("a"), start("b")
	natstest.Eventually(t, 30*time.Second, "every shard held", func() bool {
		sa, _ := a.Stats("map")
		sb, _ := b.Stats("map")
		return len(sa.Shards)+len(sb.Shards) == shards && a.Ready() == nil && b.Ready() == nil
	})
	client := natshard.NewClient(natstest.Connect(t, url))
	for i := range 100 {
		if _, err := client.Request(ctx, "map", fmt.Sprintf("user-%d", i), []byte("hi")); err != nil {
			t.Fatal(err)
		}
	}
	ts := httptest.NewServer(web.New(a, web.Options{Logger: quiet}))
	defer ts.Close()
	// A light load throughout, for the message rates.
	load, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	go func() {
		for i := 0; load.Err() == nil; i++ {
			_ = client.Publish(load, "map", fmt.Sprintf("user-%d", i%100), []byte("tick"))
			time.Sleep(5 * time.Millisecond)
		}
	}()

	actx, cancel := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.WindowSize(1400, 900))...)
	defer cancel()
	bctx, cancel := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	defer cancel()
	// The first Run starts the browser, with no timeout of its own.
	if err := chromedp.Do(bctx, chromedp.Navigate(ts.URL+"/ui/")); err != nil {
		t.Fatalf("load /ui/ in %s: %v", path, err)
	}
	run := func(what string, a chromedp.Action[chromedp.Void]) {
		t.Helper()
		tctx, cancel := context.WithTimeout(bctx, 30*time.Second)
		defer cancel()
		if _, err := chromedp.Run(tctx, a); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	run("the page shows every shard", chromedp.Poll[chromedp.Void](fmt.Sprintf(`document.querySelectorAll("[data-shard]").length === %d`, shards)))
	shown, err := chromedp.Run(bctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("[data-shard]")].map(e => e.dataset.shard + "@" + e.dataset.region + ":" + e.dataset.state)`))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(shown)
	sa, _ := a.Stats("map")
	var want []string
	for s := range shards {
		owner := "b"
		if slices.Contains(sa.Shards, s) {
			owner = "a"
		}
		want = append(want, fmt.Sprintf("%d@%s:active", s, owner))
	}
	slices.Sort(want)
	if !slices.Equal(shown, want) {
		t.Fatalf("the page shows %v, want %v", shown, want)
	}

	// An operator moves a shard of a to b (what shardctl move does).
	shard := sa.Shards[0]
	nc := natstest.Connect(t, url)
	m, err := nc.Request(protocol.MustSubjects("", "", "map").Admin(protocol.AdminMove), fmt.Appendf(nil, `{"shard":%d,"region":"b"}`, shard), 5*time.Second)
	if err != nil || !strings.Contains(string(m.Data), `"ok":true`) {
		t.Fatalf("move: %v %s", err, m.Data)
	}
	accepted := time.Now()
	run("the page shows the move", chromedp.Poll[chromedp.Void](fmt.Sprintf(
		`(e => e && e.dataset.region === "b" && e.dataset.state === "active")(document.querySelector('[data-shard="%d"]'))`, shard),
		chromedp.WithPollingInterval(5*time.Millisecond)))
	t.Logf("the page showed shard %d active on b %s after the coordinator accepted the move", shard, time.Since(accepted).Round(time.Millisecond))
	events, err := chromedp.Run(bctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#events li")].map(e => e.textContent)`))
	if err != nil {
		t.Fatal(err)
	}
	for _, state := range []string{"handoff", "binding", "active"} {
		if !slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, fmt.Sprintf("shard %d %s", shard, state)) }) {
			t.Errorf("the event list %q lacks shard %d %s", events, shard, state)
		}
	}

	// A region's detail on a click: its shards and entity ids.
	run("click region b", chromedp.Click(chromedp.CSS(`[data-region-row="b"] .region-head`)))
	run("region b's detail", chromedp.Poll[chromedp.Void](`document.querySelector("#detail-body").textContent.includes("user-")`))
	// Entity counts and message rates (the regions measure rates once a
	// second and the page asks every 2 s) come with the next polls.
	run("entity counts and message rates", chromedp.Poll[chromedp.Void](
		`/[1-9][0-9]* entities · ([1-9][0-9]*\.[0-9]|0\.[1-9]) msg\/s/.test(document.querySelector("#summary").textContent)`))

	png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(logDir(t), "shard-map.png")
	if err := os.WriteFile(file, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot of the shard map: %s", file)
}
