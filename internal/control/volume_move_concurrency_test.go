package control_test

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Two control replicas on one PostgreSQL database move volumes to a host
// whose disk fits two of them while VM creates race to attach the same
// volumes: at most two moves land (the others are no_capacity, or 409
// when a VM attached the volume first), a VM that got its volume runs on
// the volume's host, no host's disk is oversubscribed, each host's
// allocation equals its rows, and each agent holds exactly the volumes
// whose rows name its host.
func TestConcurrentVolumeMovesAndAttaches(t *testing.T) {
	url := testenv.PostgresURL(t)
	r1 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
	r2 := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
	replicas := []*testenv.Control{r1, r2}
	f := volumeFleet{c: r1, agents: map[string]*testenv.Agent{
		"h1":    testenv.StartAgent(t, testenv.AgentOptions{}),
		"tight": testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 20}),
	}}
	r1.RegisterHost(t, "h1", f.agents["h1"].Address)
	r1.RegisterHost(t, "tight", f.agents["tight"].Address)
	ctx := ctxT(t)
	const n = 8
	vols := make([]api.Volume, n)
	for i := range n {
		vols[i] = f.createVolume(t, api.VolumeCreate{Name: fmt.Sprintf("v%d", i), SizeMiB: 8, Host: "h1"})
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		moved    []string
		attached = map[string]api.VM{}
		outcomes = map[string]int{}
	)
	code := func(err error) string {
		var e *client.Error
		if errors.As(err, &e) {
			return e.Code
		}
		return "other: " + fmt.Sprint(err)
	}
	for i := range n {
		wg.Go(func() {
			_, err := replicas[i%2].Client.MoveVolume(ctx, vols[i].ID, "tight")
			mu.Lock()
			defer mu.Unlock()
			if err == nil {
				moved = append(moved, vols[i].ID)
				outcomes["moved"]++
				return
			}
			outcomes["move "+code(err)]++
		})
		if i%2 == 0 {
			wg.Go(func() {
				vm, err := replicas[(i+1)%2].Client.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("vm%d", i), Image: "sim", VCPUs: 1,
					MemoryMiB: 64, DiskMiB: 1, Volumes: []api.VMVolume{{Volume: vols[i].ID}}}, "")
				mu.Lock()
				defer mu.Unlock()
				if err == nil {
					attached[vols[i].ID] = vm
					outcomes["attached"]++
					return
				}
				outcomes["attach "+code(err)]++
			})
		}
	}
	wg.Wait()
	t.Logf("outcomes: %v", outcomes)
	for k := range outcomes {
		switch k {
		case "moved", "attached", "move " + api.CodeNoCapacity, "move " + api.CodeVolumeAttached, "move " + api.CodeConflict, "attach " + api.CodeConflict:
		default:
			t.Errorf("unexpected outcome %q", k)
		}
	}
	if len(moved) > 2 || len(moved) == 0 {
		t.Errorf("%d volumes moved to a host with room for 2 (and nothing in the way of two of them)", len(moved))
	}
	for _, v := range vols {
		got, err := r2.Client.GetVolume(ctx, v.ID)
		if err != nil || got.State != api.VolumeReady {
			t.Fatalf("volume %s after the races: %+v, %v", v.Name, got, err)
		}
		want := "h1"
		if slices.Contains(moved, v.ID) {
			want = "tight"
		}
		if got.Host != want {
			t.Errorf("volume %s is on %s, want %s", v.Name, got.Host, want)
		}
		if vm, ok := attached[v.ID]; ok && vm.Host != got.Host {
			t.Errorf("VM %s has volume %s on %s but runs on %s", vm.Name, v.Name, got.Host, vm.Host)
		}
		for name, a := range f.agents {
			if has := slices.Contains(a.VolumeIDs(t), v.ID); has != (name == got.Host) {
				t.Errorf("agent %s has volume %s: %v; its row names %s", name, v.Name, has, got.Host)
			}
		}
	}
	checkLedger(t, r1.Store)
}
