package version

import (
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

func TestLine(t *testing.T) {
	goVersion := " go1.26.8 " + runtime.GOOS + "/" + runtime.GOARCH
	for _, tc := range []struct {
		name string
		bi   *debug.BuildInfo
		want string
	}{
		{"no build information", nil, "shardd (devel) (unknown revision) " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH},
		{"-buildvcs=false", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/natshard/natshard", Version: "(devel)"}},
			"shardd (devel) (unknown revision)" + goVersion},
		{"a tag, stamped", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v1.4.0"}, Settings: []debug.BuildSetting{
			{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "2f6c1d0e9a3b4c5d6e7f8091a2b3c4d5e6f70819"},
			{Key: "vcs.time", Value: "2026-11-24T09:12:44Z"}, {Key: "vcs.modified", Value: "false"},
		}}, "shardd v1.4.0 (revision 2f6c1d0e9a3b, 2026-11-24T09:12:44Z)" + goVersion},
		{"a working tree with changes", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-20261124091244-2f6c1d0e9a3b+dirty"}, Settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: "2f6c1d0"}, {Key: "vcs.modified", Value: "true"},
		}}, "shardd v0.0.0-20261124091244-2f6c1d0e9a3b+dirty (revision 2f6c1d0, modified)" + goVersion},
		{"no main module version", &debug.BuildInfo{GoVersion: "go1.26.8"}, "shardd (devel) (unknown revision)" + goVersion},
	} {
		if got := fromBuildInfo(tc.bi).Line("shardd"); got != tc.want {
			t.Errorf("%s:\n got %q\nwant %q", tc.name, got, tc.want)
		}
	}
}

// The test binary has build information of its own; String must read it
// and say something sensible whatever the build flags.
func TestString(t *testing.T) {
	got := String("x")
	if !strings.HasPrefix(got, "x ") || !strings.Contains(got, runtime.Version()) || strings.Contains(got, "\n") {
		t.Fatalf("String: %q", got)
	}
}
