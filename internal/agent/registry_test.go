package agent

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
)

func TestRegistryCreateMakesOneEntryUnderConcurrency(t *testing.T) {
	g := newRegistry[int]("vm")
	const callers = 16
	made := make(chan *entry[int], callers)
	var wg sync.WaitGroup
	for range callers {
		wg.Go(func() { made <- g.create("a") })
	}
	wg.Wait()
	close(made)
	var winners []*entry[int]
	for e := range made {
		if e != nil {
			winners = append(winners, e)
		}
	}
	if len(winners) != 1 {
		t.Fatalf("%d of %d concurrent creates of one id made an entry, want 1", len(winners), callers)
	}
	e := winners[0]
	if g.lookup("a") != e || g.entry("a") != e || g.len() != 1 {
		t.Fatalf("lookup, entry and len do not see the one created entry")
	}
	if e.tryLock() {
		t.Fatal("a created entry must come with its operation lock held")
	}
	e.unlock()
	if !e.tryLock() {
		t.Fatal("tryLock failed on a free entry")
	}
	e.unlock()
}

func TestRegistryLockWaitsAndGivesUpWithTheContext(t *testing.T) {
	g := newRegistry[string]("snapshot")
	e := g.entry("s1")
	if err := e.lock(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := e.lock(ctx)
	var ae *Error
	if !errors.As(err, &ae) || ae.Status != http.StatusServiceUnavailable || !strings.Contains(ae.Message, "snapshot s1 is busy") ||
		!errors.Is(err, context.Canceled) {
		t.Fatalf("lock of a busy entry with an ended context = %v, want a 503 naming snapshot s1 that wraps context.Canceled", err)
	}
	got := make(chan error, 1)
	go func() { got <- e.lock(context.Background()) }()
	e.unlock()
	if err := <-got; err != nil {
		t.Fatalf("a waiter did not get the lock once it was let go: %v", err)
	}
	e.unlock()
}

func TestRegistryDropMarksGoneForWaiters(t *testing.T) {
	g := newRegistry[*snapshotRecord]("snapshot")
	e := g.entry("s1")
	e.set(&snapshotRecord{ID: "s1"})
	if err := e.lock(context.Background()); err != nil {
		t.Fatal(err)
	}
	seen := make(chan bool, 1)
	go func() {
		if err := e.lock(context.Background()); err != nil {
			t.Error(err)
			seen <- false
			return
		}
		defer e.unlock()
		_, _, gone := e.state()
		seen <- gone
	}()
	g.drop(e)
	e.unlock()
	if !<-seen {
		t.Fatal("a waiter that got the lock after a drop does not see the entry gone")
	}
	if g.lookup("s1") != nil || g.len() != 0 {
		t.Fatal("a dropped entry is still in the registry")
	}
	fresh := g.entry("s1")
	if fresh == e {
		t.Fatal("entry after a drop returned the dropped entry")
	}
	if rec, corrupt, gone := fresh.state(); rec != nil || corrupt != "" || gone {
		t.Fatalf("new entry state = %v, %q, %v; want empty", rec, corrupt, gone)
	}
	// Dropping the old entry again must not remove its successor.
	g.drop(e)
	if g.lookup("s1") != fresh {
		t.Fatal("dropping a stale entry removed the entry that replaced it")
	}
}

func TestRegistryCorruptAndRecords(t *testing.T) {
	g := newRegistry[vmRecord]("vm")
	bad := g.entry("bad")
	bad.setCorrupt(vmRecord{ID: "bad", Reason: "unreadable"}, "metadata unreadable")
	good := g.entry("good")
	good.set(vmRecord{ID: "good", State: "running"})
	if r, corrupt, gone := bad.state(); corrupt != "metadata unreadable" || r.Reason != "unreadable" || gone {
		t.Fatalf("corrupt entry state = %+v, %q, %v", r, corrupt, gone)
	}
	if r, corrupt, _ := good.state(); corrupt != "" || r.State != "running" {
		t.Fatalf("good entry state = %+v, %q", r, corrupt)
	}
	var ids []string
	for _, e := range g.all() {
		ids = append(ids, e.id)
	}
	slices.Sort(ids)
	if !slices.Equal(ids, []string{"bad", "good"}) {
		t.Fatalf("all() ids = %v, want [bad good]", ids)
	}
}
