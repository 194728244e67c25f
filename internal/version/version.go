// Package version says which build of natshard a binary is: the module
// version and the VCS revision that the Go toolchain stamped into it
// (runtime/debug.ReadBuildInfo). Both shardd and shardctl print it for
// --version:
//
//	fmt.Fprintln(stdout, version.String("shardd"))
//
// A build without VCS stamping (go build -buildvcs=false, which this
// project's GOFLAGS sets, or a build outside a repository) has no revision;
// it says "unknown revision" instead of failing.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Info is what a binary knows of its own build.
type Info struct {
	// Module is the main module's version: a tag (v1.2.3), a pseudo-version,
	// or "(devel)" for a build of a working tree without VCS stamping.
	Module string
	// Revision is the VCS commit, "" when the build was not stamped.
	Revision string
	// Time is the commit time (RFC 3339), "" when unknown.
	Time string
	// Modified: the working tree had uncommitted changes.
	Modified bool
	// Go is the toolchain's version, GOOS and GOARCH.
	Go string
}

// Read returns the running binary's Info.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		bi = nil
	}
	return fromBuildInfo(bi)
}

// fromBuildInfo reads Info from build information (nil: none, as in a
// binary built without module support).
func fromBuildInfo(bi *debug.BuildInfo) Info {
	info := Info{Module: "(devel)", Go: runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH}
	if bi == nil {
		return info
	}
	if bi.GoVersion != "" {
		info.Go = bi.GoVersion + " " + runtime.GOOS + "/" + runtime.GOARCH
	}
	if bi.Main.Version != "" {
		info.Module = bi.Main.Version
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Revision = s.Value
		case "vcs.time":
			info.Time = s.Value
		case "vcs.modified":
			info.Modified = s.Value == "true"
		}
	}
	return info
}

// String is the line --version prints: the program, the module version,
// the revision (its first 12 characters, with the commit time and
// "modified" when they are known) and the Go version. For example:
//
//	shardd v1.4.0 (revision 2f6c1d0e9a3b, 2026-11-24T09:12:44Z) go1.26.8 linux/amd64
//	shardctl (devel) (unknown revision) go1.26.8 linux/amd64
func String(program string) string { return Read().Line(program) }

// Line formats i as String does.
func (i Info) Line(program string) string {
	rev := "unknown revision"
	if i.Revision != "" {
		parts := []string{"revision " + i.Revision[:min(12, len(i.Revision))]}
		if i.Time != "" {
			parts = append(parts, i.Time)
		}
		if i.Modified {
			parts = append(parts, "modified")
		}
		rev = strings.Join(parts, ", ")
	}
	return fmt.Sprintf("%s %s (%s) %s", program, i.Module, rev, i.Go)
}
