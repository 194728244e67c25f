package benchlab

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// progress draws a bar on stderr when it is a terminal (or --progress).
type progress struct {
	out     io.Writer
	enabled bool
	stop    chan struct{}
	done    chan struct{}
	shown   bool
}

func newProgress(stderr io.Writer, force bool) *progress {
	enabled := force
	if f, ok := stderr.(*os.File); ok && !enabled {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			enabled = true
		}
	}
	return &progress{out: stderr, enabled: enabled}
}

// note shows a line of text until the next note, phase or clear.
func (p *progress) note(format string, args ...any) {
	if !p.enabled {
		return
	}
	p.clear()
	fmt.Fprintf(p.out, "\r\033[K%s", fmt.Sprintf(format, args...))
	p.shown = true
}

// phase draws label and a bar of done()/total every 200 ms until the next
// phase, note or clear.
func (p *progress) phase(label string, total int64, done func() int64) {
	if !p.enabled {
		return
	}
	p.clear()
	p.stop, p.done = make(chan struct{}), make(chan struct{})
	stop, finished := p.stop, p.done
	draw := func() {
		n := min(max(done(), 0), total)
		const width = 30
		fill := int(int64(width) * n / max(total, 1))
		fmt.Fprintf(p.out, "\r\033[K%-34s [%s%s] %3d%%", label, strings.Repeat("=", fill), strings.Repeat(" ", width-fill), 100*n/max(total, 1))
	}
	p.shown = true
	go func() {
		defer close(finished)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			draw()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
}

// clear ends the current phase and erases its line.
func (p *progress) clear() {
	if p.stop != nil {
		close(p.stop)
		<-p.done
		p.stop = nil
	}
	if p.shown {
		fmt.Fprint(p.out, "\r\033[K")
		p.shown = false
	}
}

var errNoProgress = errors.New("no message received for 10 s")
