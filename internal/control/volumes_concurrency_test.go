package control_test

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Two control replicas on one PostgreSQL database take concurrent volume
// creates (placed and pinned) and VM creates on hosts whose disks fit 60
// of them: exactly 60 land, the rest are no_capacity, no host's disk is
// oversubscribed, each host's allocation equals its rows of VMs plus
// volumes, and the agents hold exactly the volumes that have rows.
func TestConcurrentVolumeAndVMCreatesShareHostDisk(t *testing.T) {
	url := testenv.PostgresURL(t)
	r1 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
	r2 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
	replicas := []*testenv.Control{r1, r2}
	const (
		hosts   = 6
		perHost = 10 // disk for 10 units of 1024 MiB each: 60 in all
		unit    = 1024
		creates = 100
	)
	agents := map[string]*testenv.Agent{}
	for i := range hosts {
		name := fmt.Sprintf("host-%02d", i)
		agents[name] = testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 64, MemoryMiB: 64 * 1024, DiskMiB: perHost * unit})
		r1.RegisterHost(t, name, agents[name].Address)
	}
	ctx := ctxT(t)
	var (
		placed, full atomic.Int64
		wg           sync.WaitGroup
		mu           sync.Mutex
		others       []error
	)
	for i := range creates {
		c := replicas[i%2].Client
		wg.Go(func() {
			var err error
			switch i % 4 {
			case 0, 1: // a VM
				_, err = c.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("vm-%03d", i), Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: unit}, "")
			case 2: // a placed volume
				_, err = c.CreateVolume(ctx, api.VolumeCreate{Name: fmt.Sprintf("vol-%03d", i), SizeMiB: unit})
			case 3: // a volume pinned to one of two hosts
				_, err = c.CreateVolume(ctx, api.VolumeCreate{Name: fmt.Sprintf("vol-%03d", i), SizeMiB: unit, Host: fmt.Sprintf("host-%02d", i%2)})
			}
			var e *client.Error
			switch {
			case err == nil:
				placed.Add(1)
			case errors.As(err, &e) && e.Code == api.CodeNoCapacity:
				full.Add(1)
			default:
				mu.Lock()
				others = append(others, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(others) > 0 {
		t.Fatalf("creates failed with other errors than no_capacity: %v", others)
	}
	if placed.Load() != hosts*perHost || full.Load() != creates-hosts*perHost {
		t.Errorf("%d placed and %d no_capacity; want %d and %d", placed.Load(), full.Load(), hosts*perHost, creates-hosts*perHost)
	}
	checkLedger(t, r1.Store)
	vols, err := r2.Store.ListVolumes(ctx, store.VolumeFilter{})
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]int{}
	for _, v := range vols {
		if v.State != store.VolumeReady {
			t.Errorf("volume %s is %s after its create answered", v.ID, v.State)
		}
		rows[v.HostName]++
	}
	for name, a := range agents {
		if got := len(a.VolumeIDs(t)); got != rows[name] {
			t.Errorf("agent of %s holds %d volumes, its rows say %d", name, got, rows[name])
		}
	}
}
