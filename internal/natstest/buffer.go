package natstest

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer that a process's or logger's writer and the
// test reading it may use at once: what tests capture logs and output in.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
