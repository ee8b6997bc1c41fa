package agent

import (
	"context"
	"fmt"
	"net/http"
	"sync"
)

// registry holds the records of one kind (VMs, snapshots) by id. Each id
// has an entry with an operation lock, held while a mutating operation of
// that id runs, and its record under a mutex of its own, so that readers
// never wait for an operation.
type registry[R any] struct {
	noun string // what an id names, for messages: "vm", "snapshot"

	mu      sync.Mutex
	entries map[string]*entry[R]
}

func newRegistry[R any](noun string) *registry[R] {
	return &registry[R]{noun: noun, entries: map[string]*entry[R]{}}
}

// entry is one id in a registry.
type entry[R any] struct {
	id   string
	noun string
	// op is held (one token in a channel, so that waiting honours a
	// context) while a mutating operation of this id runs.
	op chan struct{}

	mu      sync.Mutex // guards the fields below
	rec     R
	corrupt string // why its metadata cannot be used ("" when it can): only delete works
	gone    bool   // dropped from the registry; a waiter that gets op must look again
}

// lock takes the operation lock, or fails with a 503 when ctx ends first.
func (e *entry[R]) lock(ctx context.Context) error {
	select {
	case e.op <- struct{}{}:
		return nil
	case <-ctx.Done():
		return &Error{Status: http.StatusServiceUnavailable, Code: CodeUnavailable,
			Message: fmt.Sprintf("%s %s is busy with another operation; retry later", e.noun, e.id), Err: ctx.Err()}
	}
}

// tryLock takes the operation lock when it is free.
func (e *entry[R]) tryLock() bool {
	select {
	case e.op <- struct{}{}:
		return true
	default:
		return false
	}
}

func (e *entry[R]) unlock() { <-e.op }

// state returns the record, why it is corrupt ("" when it is not) and
// whether the entry was dropped.
func (e *entry[R]) state() (R, string, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.rec, e.corrupt, e.gone
}

func (e *entry[R]) set(r R) {
	e.mu.Lock()
	e.rec = r
	e.mu.Unlock()
}

// setCorrupt records that the id's metadata cannot be used, and why; r is
// what is reported of it meanwhile.
func (e *entry[R]) setCorrupt(r R, reason string) {
	e.mu.Lock()
	e.rec, e.corrupt = r, reason
	e.mu.Unlock()
}

func (g *registry[R]) lookup(id string) *entry[R] {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.entries[id]
}

// acquire returns the entry of id with its operation lock held, or nil
// when id has none (or it was dropped while this call waited).
func (g *registry[R]) acquire(ctx context.Context, id string) (*entry[R], error) {
	e := g.lookup(id)
	if e == nil {
		return nil, nil
	}
	if err := e.lock(ctx); err != nil {
		return nil, err
	}
	if _, _, gone := e.state(); gone {
		e.unlock()
		return nil, nil
	}
	return e, nil
}

// entry returns the entry of id, making an empty one when there is none.
func (g *registry[R]) entry(id string) *entry[R] {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.entries[id]
	if e == nil {
		e = g.newEntryLocked(id)
	}
	return e
}

// create makes the entry of id with its operation lock taken, or returns
// nil when id has an entry already.
func (g *registry[R]) create(id string) *entry[R] {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.entries[id] != nil {
		return nil
	}
	e := g.newEntryLocked(id)
	e.op <- struct{}{} // new and unseen: taking it cannot block
	return e
}

func (g *registry[R]) newEntryLocked(id string) *entry[R] {
	e := &entry[R]{id: id, noun: g.noun, op: make(chan struct{}, 1)}
	g.entries[id] = e
	return e
}

// drop removes e from the registry and marks it gone. The caller holds e's
// operation lock.
func (g *registry[R]) drop(e *entry[R]) {
	g.mu.Lock()
	if g.entries[e.id] == e {
		delete(g.entries, e.id)
	}
	g.mu.Unlock()
	e.mu.Lock()
	e.gone = true
	e.mu.Unlock()
}

// all returns the entries, in no order.
func (g *registry[R]) all() []*entry[R] {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*entry[R], 0, len(g.entries))
	for _, e := range g.entries {
		out = append(out, e)
	}
	return out
}

func (g *registry[R]) len() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.entries)
}
