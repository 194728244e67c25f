// Command healthcheck is the health check of the docker-compose.yml
// containers, whose images are FROM scratch (no shell, no curl):
//
//	healthcheck http://127.0.0.1:8222/healthz   GET; healthy on 200 (nats-server)
//	healthcheck region                          healthy when this container's region answers a query (shardd)
//
// region reads shardd's own environment (NATS_URL, NATSHARD_REGION,
// NATSHARD_TYPE, NATSHARD_CONTROL_PREFIX): the region must be connected to
// NATS and serving its query subject. Exit status 0 healthy, 1 not (the
// reason on standard output, which Docker keeps in the container's health
// log), 2 a bad command line.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

const timeout = 2 * time.Second

func main() {
	if len(os.Args) != 2 {
		fmt.Println("usage: healthcheck <http URL> | healthcheck region")
		os.Exit(2)
	}
	if err := check(os.Args[1], os.Getenv); err != nil {
		fmt.Println("unhealthy:", err)
		os.Exit(1)
	}
}

func check(what string, getenv func(string) string) error {
	if strings.HasPrefix(what, "http://") || strings.HasPrefix(what, "https://") {
		return checkHTTP(what)
	}
	if what == "region" {
		return checkRegion(getenv)
	}
	return fmt.Errorf("%q is neither an http URL nor region", what)
}

func checkHTTP(url string) error {
	c := http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

func checkRegion(getenv func(string) string) error {
	url, region := getenv("NATS_URL"), getenv("NATSHARD_REGION")
	if url == "" || region == "" {
		return fmt.Errorf("NATS_URL and NATSHARD_REGION must be set")
	}
	typ := getenv("NATSHARD_TYPE")
	if typ == "" {
		typ = "kv"
	}
	subjects, err := protocol.NewSubjects("", getenv("NATSHARD_CONTROL_PREFIX"), typ)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(url, nats.Name("healthcheck "+region), nats.Timeout(timeout), nats.MaxReconnects(0))
	if err != nil {
		return err
	}
	defer nc.Close()
	m, err := nc.Request(subjects.Query(region), []byte(`{}`), timeout)
	if err != nil {
		return fmt.Errorf("region %s: %w", region, err)
	}
	var ans struct {
		protocol.QueryAnswer
		Error string `json:"error"`
	}
	if err := json.Unmarshal(m.Data, &ans); err != nil {
		return fmt.Errorf("region %s answered %q: %w", region, m.Data, err)
	}
	if ans.Error != "" || ans.Region != region {
		return fmt.Errorf("region %s answered %s", region, m.Data)
	}
	return nil
}
