package benchlab

import (
	"bytes"
	"fmt"
	"os"
	"runtime/pprof"

	"github.com/google/pprof/profile"
)

// SideProfiles takes a CPU profile of each throughput round
// (--side-profiles) and merges each side's rounds into one profile: both
// sides handle the same messages, so the difference of the two (go tool
// pprof -diff_base) is what natshard adds to raw NATS. The whole-run
// profile (--cpuprofile) cannot tell the sides apart: they share the
// process, the server and the publishers. A nil *SideProfiles takes none.
type SideProfiles struct {
	prefix string
	rounds map[string][]*profile.Profile // side: one profile per round
	buf    bytes.Buffer
}

// NewSideProfiles returns the profiles to write under prefix ("": nil,
// which takes none).
func NewSideProfiles(prefix string) *SideProfiles {
	if prefix == "" {
		return nil
	}
	return &SideProfiles{prefix: prefix, rounds: map[string][]*profile.Profile{}}
}

// Start starts the CPU profile of a round.
func (p *SideProfiles) Start() error {
	if p == nil {
		return nil
	}
	p.buf.Reset()
	return pprof.StartCPUProfile(&p.buf)
}

// Stop stops the round's profile and keeps it as side's.
func (p *SideProfiles) Stop(side string) error {
	if p == nil {
		return nil
	}
	pprof.StopCPUProfile()
	prof, err := profile.Parse(&p.buf)
	if err != nil {
		return fmt.Errorf("--side-profiles: the profile of a %s round: %w", side, err)
	}
	p.rounds[side] = append(p.rounds[side], prof)
	return nil
}

// Write merges each side's rounds and writes them to
// <prefix>.<delivery>.<side>.prof, and forgets them.
func (p *SideProfiles) Write(delivery string) error {
	if p == nil {
		return nil
	}
	for side, rounds := range p.rounds {
		merged, err := profile.Merge(rounds)
		if err != nil {
			return fmt.Errorf("--side-profiles: merging the %s rounds: %w", side, err)
		}
		if err := writeProfile(p.sideFile(delivery, side), merged); err != nil {
			return fmt.Errorf("--side-profiles: %w", err)
		}
	}
	clear(p.rounds)
	return nil
}

// sideFile is where Write puts side's profile of delivery.
func (p *SideProfiles) sideFile(delivery, side string) string {
	return fmt.Sprintf("%s.%s.%s.prof", p.prefix, delivery, side)
}

func writeProfile(path string, prof *profile.Profile) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := prof.Write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
