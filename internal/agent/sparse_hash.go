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
	full chan chunk  // to hash
	free chan []byte // hashed, to fill again
	done chan struct{}
	once sync.Once
}

// chunk is bytes to hash: one of the pipeHash's own buffers (own), to be
// filled again once hashed, or bytes the writer keeps unchanged until sum
// or stop (addShared).
type chunk struct {
	b   []byte
	own bool
}

func newPipeHash(h hash.Hash) *pipeHash {
	p := &pipeHash{h: h, full: make(chan chunk, 4*pipeBuffers), free: make(chan []byte, pipeBuffers),
		done: make(chan struct{})}
	for range pipeBuffers - 1 {
		p.free <- make([]byte, 0, sparseBlock)
	}
	p.cur = make([]byte, 0, sparseBlock)
	go func() {
		defer close(p.done)
		for c := range p.full {
			p.h.Write(c.b)
			if c.own {
				p.free <- c.b[:0]
			}
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
			p.full <- chunk{p.cur, true}
			p.cur = <-p.free
		}
	}
}

// addShared hashes b after what was added before, without copying it: the
// caller leaves b unchanged until sum or stop (a mapping of a file that
// nothing writes meanwhile).
func (p *pipeHash) addShared(b []byte) {
	if len(p.cur) > 0 {
		p.full <- chunk{p.cur, true}
		p.cur = <-p.free
	}
	p.full <- chunk{b, false}
}

// sum waits until everything written is hashed and returns the hex digest.
func (p *pipeHash) sum() string {
	if len(p.cur) > 0 {
		p.full <- chunk{p.cur, true}
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
