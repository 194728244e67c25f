package host

import (
	"sync"
	"time"
)

// turnBudget is how many messages a worker handles for one cell before
// it puts the cell back at the end of the ready queue, so that a busy
// entity does not keep a worker while other cells wait (Akka's
// dispatcher throughput).
const turnBudget = 64

// task is a cell made ready: its worker runs it until its mailbox is
// empty or its budget spent. first (when it has a message) is the message
// that made an idle cell ready, handled before the mailbox; the cell's
// mailbox then holds only the messages that came after it.
type task struct {
	se    *shardEntities
	c     *cell
	id    string // the cell's key in se.cells
	first envelope
}

// taskQueue is a FIFO of tasks in a ring buffer; host.qmu guards it.
type taskQueue struct {
	buf     []task
	head, n int
}

func (q *taskQueue) push(t task) {
	if q.n == len(q.buf) {
		buf := make([]task, max(64, 2*len(q.buf)))
		for i := range q.n {
			buf[i] = q.buf[(q.head+i)%len(q.buf)]
		}
		q.buf, q.head = buf, 0
	}
	q.buf[(q.head+q.n)%len(q.buf)] = t
	q.n++
}

func (q *taskQueue) pop() (task, bool) {
	if q.n == 0 {
		return task{}, false
	}
	t := q.buf[q.head]
	q.buf[q.head] = task{}
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	if q.n == 0 && len(q.buf) > 1024 {
		q.buf, q.head = nil, 0 // a burst's queue is not kept
	}
	return t, true
}

// schedule queues a cell the caller marked running and makes sure a
// worker will take it: if every worker is running a cell (which may
// block: Handle, Stop and the Factory may do I/O), a parked one is woken
// or a new one started.
func (h *Host) schedule(t task) {
	h.qmu.Lock()
	h.ready.push(t)
	if h.searching > 0 {
		h.qmu.Unlock()
		return
	}
	h.searching++
	w := h.unparkLocked()
	h.qmu.Unlock()
	h.wake(w)
}

// unparkLocked takes the worker parked last, nil if none (h.qmu held).
func (h *Host) unparkLocked() *workerState {
	n := len(h.idle)
	if n == 0 {
		return nil
	}
	w := h.idle[n-1]
	h.idle[n-1] = nil
	h.idle = h.idle[:n-1]
	return w
}

// wake hands the search for ready cells to parked worker w, or to a new
// worker when w is nil.
func (h *Host) wake(w *workerState) {
	if w == nil {
		go h.worker()
		return
	}
	w.wake <- true
}

// maxIdleWorkers bounds the workers parked in a host, each for idleKeep
// to twice that (reap): a worker parked when the queue emptied takes the
// next ready cell at the cost of a wake-up, with its stack grown already,
// where a new goroutine would start with a small one and grow it in
// Handle.
const (
	maxIdleWorkers = 64
	idleKeep       = 500 * time.Millisecond
)

// worker runs ready cells; when none is left it parks (at most
// maxIdleWorkers, until reap ends it) or exits. It counts as searching
// (host.searching) except while it runs a cell or is parked; a worker
// that takes a cell and leaves others queued with no other worker
// searching wakes or starts one. So while cells are queued some worker
// is about to take one, whatever the others are blocked in; and a burst
// of messages to idle entities is run by a few goroutines, not one per
// message.
func (h *Host) worker() {
	w := &workerState{spare: newMailq(), wake: make(chan bool, 1)}
	h.qmu.Lock()
	for {
		t, ok := h.ready.pop()
		h.searching--
		if !ok {
			if !h.park(w) {
				return
			}
			continue // h.qmu held, searching again
		}
		var next *workerState
		more := h.ready.n > 0 && h.searching == 0
		if more {
			h.searching++
			next = h.unparkLocked()
		}
		h.qmu.Unlock()
		if more {
			h.wake(next)
		}
		again := h.run(t, w)
		h.qmu.Lock()
		h.searching++
		if again {
			t.first = envelope{}
			h.ready.push(t)
		}
	}
}

// park parks w (h.qmu held, released while parked) until a schedule
// wakes it: it returns true with h.qmu held and w counted as searching.
// It returns false, h.qmu released, when w should exit: too many parked
// already, or it stayed parked through a whole reap period (reap).
func (h *Host) park(w *workerState) bool {
	if len(h.idle) >= maxIdleWorkers {
		h.qmu.Unlock()
		freeMailq(w.spare)
		return false
	}
	w.old = false
	h.idle = append(h.idle, w)
	if !h.reaping {
		h.reaping = true
		if h.reaper == nil {
			h.reaper = time.AfterFunc(idleKeep, h.reap)
		} else {
			h.reaper.Reset(idleKeep)
		}
	}
	h.qmu.Unlock()
	if !<-w.wake {
		freeMailq(w.spare)
		return false
	}
	h.qmu.Lock()
	return true
}

// reap, every idleKeep while workers are parked, ends those parked since
// the reap before: a worker parks for idleKeep to twice that. One timer
// for the host, rather than one per parking, keeps a parking to a channel
// receive.
func (h *Host) reap() {
	h.qmu.Lock()
	defer h.qmu.Unlock()
	kept := h.idle[:0]
	for _, w := range h.idle {
		if w.old {
			w.wake <- false
			continue
		}
		w.old = true
		kept = append(kept, w)
	}
	clear(h.idle[len(kept):])
	h.idle = kept
	if len(h.idle) > 0 {
		h.reaper.Reset(idleKeep)
	} else {
		h.reaping = false
	}
}

// maxSpare bounds the mailbox array a worker keeps between cells.
const maxSpare = 256

// mailq is a cell's mailbox while it has messages queued: the cell
// holds a pointer (8 bytes, nil when idle) rather than the slice, so that
// an idle entity costs less. Mailboxes come from mailqs, with room for
// inline messages (more grow q), and go back to it when their cell goes
// idle or when a worker has taken their messages.
type mailq struct {
	q      []envelope
	inline [8]envelope
}

var mailqs = sync.Pool{New: func() any {
	m := new(mailq)
	m.q = m.inline[:0]
	return m
}}

// newMailq returns an empty mailbox.
func newMailq() *mailq { return mailqs.Get().(*mailq) }

// freeMailq gives an empty mailbox back to mailqs (nil: none).
func freeMailq(m *mailq) {
	if m == nil {
		return
	}
	m.trim()
	mailqs.Put(m)
}

// trim empties m, dropping an array a burst grew beyond maxSpare.
func (m *mailq) trim() {
	if cap(m.q) > maxSpare {
		m.q = m.inline[:0]
	}
	m.q = m.q[:0]
}

// box is c's mailbox, made if it has none (se.mu held).
func (c *cell) box() *mailq {
	if c.mailbox == nil {
		c.mailbox = newMailq()
	}
	return c.mailbox
}

// len is how many messages m holds (0 for nil).
func (m *mailq) len() int {
	if m == nil {
		return 0
	}
	return len(m.q)
}

// workerState is what a worker reuses from message to message: an empty
// mailbox array, and the Message given to Handle (valid during Handle
// only, as Message says).
type workerState struct {
	spare *mailq // empty
	msg   Message
	run   []pending // the run of a Flusher's messages handled in memory (flush.go)
	wake  chan bool // true: a schedule unparked it; false: reap ended it
	old   bool      // parked through a reap already (h.qmu)
}

// keep makes the empty mailbox mq w's spare, without an array grown
// beyond maxSpare.
func (w *workerState) keep(mq *mailq) {
	mq.trim()
	w.spare = mq
}
