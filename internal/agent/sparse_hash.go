package agent

import (
	"hash"
	"sync"
)

// pipeBuffers is how many buffers a pipeHash has in flight.
const pipeBuffers = 4

// pipeHash is a hash that hashes in a goroutine of its own: a RAM image is
// tens of MiB of non-zero pages, and hashing them as they are copied (a
// snapshot's copy out of the guest, a pull's receipt) doubled the time of
// that copy, which is the source's pause and a spilled child's wait. The
// writer goes on while the previous buffers are hashed.
//
// Every pipeHash must end with sum or stop, which end its goroutine.
type pipeHash struct {
	h    hash.Hash
	cur  []byte      // being filled
	full chan []byte // to hash
	free chan []byte // hashed, to fill again
	done chan struct{}
	once sync.Once
}

func newPipeHash(h hash.Hash) *pipeHash {
	p := &pipeHash{h: h, full: make(chan []byte, pipeBuffers), free: make(chan []byte, pipeBuffers),
		done: make(chan struct{})}
	for range pipeBuffers - 1 {
		p.free <- make([]byte, 0, sparseBlock)
	}
	p.cur = make([]byte, 0, sparseBlock)
	go func() {
		defer close(p.done)
		for b := range p.full {
			p.h.Write(b)
			p.free <- b[:0]
		}
	}()
	return p
}

// Write is add, for an io.Writer; it never fails.
func (p *pipeHash) Write(b []byte) (int, error) {
	p.add(b)
	return len(b), nil
}

// add copies b into the buffers; full ones go to the hashing goroutine.
func (p *pipeHash) add(b []byte) {
	for len(b) > 0 {
		k := min(len(b), cap(p.cur)-len(p.cur))
		p.cur = append(p.cur, b[:k]...)
		b = b[k:]
		if len(p.cur) == cap(p.cur) {
			p.full <- p.cur
			p.cur = <-p.free
		}
	}
}

// sum waits until everything written is hashed and returns the hex digest.
func (p *pipeHash) sum() string {
	if len(p.cur) > 0 {
		p.full <- p.cur
		p.cur = nil
	}
	p.stop()
	return digestOf(p.h)
}

// stop ends the hashing goroutine (on an error path, without a digest).
func (p *pipeHash) stop() {
	p.once.Do(func() { close(p.full) })
	<-p.done
}
