package upgradetest

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// rollingLoad is a steady load of creates and deletes through two control
// replicas, as Terraform behind a load balancer sends it: each call goes
// to one replica and, when that one does not answer, to the other with
// the same idempotency key.
type rollingLoad struct {
	clients []*client.Client
	creates atomic.Int64
	deletes atomic.Int64

	mu      sync.Mutex
	errs    []string
	longest time.Duration
	waits   []time.Duration
}

func (l *rollingLoad) fail(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, fmt.Sprintf(format, args...))
}

// unanswered says whether err is a replica that did not answer (or
// answered that it cannot serve now), where a client tries the other.
func unanswered(err error) bool {
	return errors.Is(err, client.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded)
}

func (l *rollingLoad) create(ctx context.Context, worker, n int) (string, bool) {
	in := upgradeVM(fmt.Sprintf("roll-%d-%d", worker, n))
	key := client.NewIdempotencyKey()
	start := time.Now()
	var err error
	for attempt := range 4 {
		var vm api.VM
		vm, err = l.clients[(worker+attempt)%len(l.clients)].CreateVM(ctx, in, key)
		if err == nil {
			d := time.Since(start)
			l.mu.Lock()
			l.longest = max(l.longest, d)
			l.waits = append(l.waits, d)
			l.mu.Unlock()
			l.creates.Add(1)
			return vm.ID, true
		}
		if !unanswered(err) {
			break
		}
	}
	l.fail("create %s: %v", in.Name, err)
	return "", false
}

func (l *rollingLoad) delete(ctx context.Context, worker int, id string) {
	var err error
	for attempt := range 4 {
		err = l.clients[(worker+attempt)%len(l.clients)].DeleteVM(ctx, id)
		if err == nil || errors.Is(err, client.ErrNotFound) {
			l.deletes.Add(1)
			return
		}
		if !unanswered(err) {
			break
		}
	}
	l.fail("delete %s: %v", id, err)
}

// TestRollingUpgradeUnderLoad upgrades 2 control replicas and 3 agents of
// the previous release to this one, one process at a time (replicas first,
// then agents; each stopped with SIGTERM and started again on the same
// address and state), while 3 clients create and delete VMs without a
// pause. It logs the errors the clients saw past their retries and the
// longest time a create waited, and fails on any client error, on a VM
// lost or doubled, or on a ledger that disagrees. It asserts no timing.
func TestRollingUpgradeUnderLoad(t *testing.T) {
	b := upgradeBinaries(t)
	ctx := ctxFor(t, 10*time.Minute)
	db := postgres(t)
	replicas := []*kvmdProc{startUpgradeControl(t, b.old, db), startUpgradeControl(t, b.old, db)}
	agents := registerAndSync(t, ctx, replicas[0].client(),
		[]*kvmdProc{startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.old)})
	load := &rollingLoad{clients: []*client.Client{replicas[0].client(), replicas[1].client()}}

	const (
		workers   = 3
		maxOps    = 400 // per worker: the load is bounded whatever happens
		liveCount = 4   // VMs each worker keeps before it deletes its oldest
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	kept := make([][]string, workers)
	for w := range workers {
		wg.Go(func() {
			var live []string
			for n := range maxOps {
				select {
				case <-stop:
					kept[w] = live
					return
				default:
				}
				if id, ok := load.create(ctx, w, n); ok {
					live = append(live, id)
				}
				if len(live) > liveCount {
					load.delete(ctx, w, live[0])
					live = live[1:]
				}
			}
			kept[w] = live
		})
	}
	// Each step waits for some load on the fleet as it is, then replaces
	// one process.
	progress := func(what string) {
		from := load.creates.Load()
		waitFor(t, what, func() error {
			if n := load.creates.Load(); n < from+15 {
				return fmt.Errorf("%d creates since the last step, want 15", n-from)
			}
			return nil
		})
	}
	start := time.Now()
	progress("load on the previous release")
	for i, r := range replicas {
		r.restartAs(t, b.current)
		t.Logf("replica %d upgraded at %v (%d creates, %d deletes so far)", i, time.Since(start).Round(time.Millisecond), load.creates.Load(), load.deletes.Load())
		progress(fmt.Sprintf("load after replica %d", i))
	}
	for i := range len(agents) {
		name := fmt.Sprintf("host-%d", i)
		agents[name].restartAs(t, b.current)
		waitFor(t, name+" alive after its upgrade", func() error { return allAlive(ctx, replicas[0].client()) })
		t.Logf("agent of %s upgraded at %v (%d creates, %d deletes so far)", name, time.Since(start).Round(time.Millisecond), load.creates.Load(), load.deletes.Load())
		progress("load after the agent of " + name)
	}
	close(stop)
	wg.Wait()
	elapsed := time.Since(start)

	load.mu.Lock()
	waits := append([]time.Duration(nil), load.waits...)
	errs := append([]string(nil), load.errs...)
	load.mu.Unlock()
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	p50, p99 := waits[len(waits)/2], waits[len(waits)*99/100]
	t.Logf("rolling upgrade of 2 replicas and 3 agents (%s -> this tree) under load: %v, %d creates, %d deletes; "+
		"client errors past retries: %d; create wait p50 %v, p99 %v, longest %v",
		b.oldCommit[:7], elapsed.Round(time.Millisecond), load.creates.Load(), load.deletes.Load(), len(errs),
		p50.Round(time.Millisecond), p99.Round(time.Millisecond), load.longest.Round(time.Millisecond))
	for _, e := range errs {
		t.Errorf("client error past retries: %s", e)
	}

	keep := map[string]api.VMCreate{}
	vms, err := replicas[0].client().AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]string{}
	for _, vm := range vms {
		names[vm.ID] = vm.Name
	}
	for _, live := range kept {
		for _, id := range live {
			keep[id] = upgradeVM(names[id])
		}
	}
	checkFleet(t, ctx, load.clients, agents, keep)
	if len(vms) != len(keep) {
		t.Errorf("%d VM rows after the load, the clients kept %d", len(vms), len(keep))
	}
}
