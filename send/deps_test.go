package send_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoServerDependency: a program that only sends, importing package
// send, links no package of the NATS server (issue 31, item 6).
func TestNoServerDependency(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to list the package's dependencies: %v", err)
	}
	out, err := exec.Command(goTool, "list", "-deps", "github.com/natshard/natshard/send").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	var server []string
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "github.com/nats-io/nats-server") {
			server = append(server, p)
		}
	}
	if len(server) > 0 {
		t.Fatalf("package send depends on the NATS server through %d packages: %s", len(server), strings.Join(server, " "))
	}
	if !strings.Contains(string(out), "github.com/nats-io/nats.go") {
		t.Fatalf("go list -deps listed no nats.go: the listing is not of package send\n%s", out)
	}
}
