package control_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A fork of a VM with a read-write volume: every child gets a volume of
// its own, "<volume>-<child>", a clone of the snapshot's frozen point on
// the child's host (pulled from the source's agent for a spilled child),
// reserved there and attached read-write before the child starts. The
// children's volumes outlive them like any volume.
func TestForkChildrenGetTheirOwnVolumes(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		// h1 has room for the source and one child; the rest spill to h2.
		f := startVolumeFleet(t, dbURL, map[string]testenv.AgentOptions{
			"h1": {VCPUs: 8, MemoryMiB: 2048, DiskMiB: 100000}, "h2": {},
		})
		data := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 100, Host: "h1"})
		in := smallVM("src")
		in.Volumes = []api.VMVolume{{Volume: "data"}}
		src, err := f.c.Client.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		fk, err := f.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 3, Placement: api.PlacementColocate}, "")
		if err != nil {
			t.Fatalf("fork of a vm with a volume: %v", err)
		}
		var hosts []string
		seen := map[string]bool{data.ID: true}
		for _, ch := range fk.Children {
			hosts = append(hosts, ch.Host)
			vm, err := f.c.Client.GetVM(ctx, ch.ID)
			if err != nil {
				t.Fatal(err)
			}
			if len(vm.Volumes) != 1 || vm.Volumes[0].ReadOnly || seen[vm.Volumes[0].VolumeID] {
				t.Fatalf("child %s volumes = %+v, want one of its own named data-%s, read-write", ch.Name, vm.Volumes, ch.Name)
			}
			id := vm.Volumes[0].VolumeID
			seen[id] = true
			var v api.Volume
			if st, e := f.call(t, http.MethodGet, "/v1/volumes/"+id, nil, &v); st != http.StatusOK {
				t.Fatalf("child volume %s: %d %+v", id, st, e)
			}
			if v.Name != "data-"+ch.Name || v.Host != ch.Host || v.State != "ready" || v.SizeMiB != 100 || len(v.AttachedTo) != 1 || v.AttachedTo[0].VMID != ch.ID {
				t.Fatalf("child %s's volume = %+v, want data-%s, ready on %s, 100 MiB, attached to it", ch.Name, v, ch.Name, ch.Host)
			}
			onAgent, err := f.agents[ch.Host].Client.GetVolume(ctx, id)
			if err != nil {
				t.Fatalf("child volume on the agent of %s: %v", ch.Host, err)
			}
			s := onAgent.Source
			if s == nil || s.Snapshot != fk.ID || s.Volume != data.ID || (s.Peer != nil) != (ch.Host != "h1") || onAgent.AttachedTo != ch.ID {
				t.Fatalf("child volume on agent %s = %+v (source %+v), want a clone of the fork's frozen point of %s, pulled iff spilled, attached to %s",
					ch.Host, onAgent, s, data.ID, ch.ID)
			}
		}
		if !slices.Equal(hosts, []string{"h1", "h2", "h2"}) {
			t.Fatalf("children on %v, want one beside the source and two spilled", hosts)
		}
		checkLedger(t, f.c.Store)

		// A child's delete keeps its volume, detached; it is deleted
		// explicitly, like any volume.
		gone := fk.Children[0]
		vm, _ := f.c.Client.GetVM(ctx, gone.ID)
		vol := vm.Volumes[0].VolumeID
		if err := f.c.Client.DeleteVM(ctx, gone.ID); err != nil {
			t.Fatal(err)
		}
		var v api.Volume
		if st, e := f.call(t, http.MethodGet, "/v1/volumes/"+vol, nil, &v); st != http.StatusOK || len(v.AttachedTo) != 0 {
			t.Fatalf("volume of a deleted child: %d %+v %+v, want kept and detached", st, v, e)
		}
		if st, e := f.call(t, http.MethodDelete, "/v1/volumes/"+vol, nil, nil); st != http.StatusNoContent {
			t.Fatalf("delete the volume of a deleted child: %d %+v", st, e)
		}
		if ids := f.agents["h1"].VolumeIDs(t); slices.Contains(ids, vol) {
			t.Fatalf("agent h1 still has deleted volume %s", vol)
		}
		checkLedger(t, f.c.Store)
	})
}

// Read-only volumes are shared: every child attaches the source's volume
// read-only, and so the children run on its host, spread or not.
func TestForkChildrenShareReadOnlyVolumes(t *testing.T) {
	ctx := context.Background()
	f := startVolumeFleet(t, "", map[string]testenv.AgentOptions{"h1": {}, "h2": {}})
	ref := f.createVolume(t, api.VolumeCreate{Name: "ref", SizeMiB: 50, Host: "h1"})
	in := smallVM("src")
	in.Volumes = []api.VMVolume{{Volume: "ref", ReadOnly: true}}
	src, err := f.c.Client.CreateVM(ctx, in, "")
	if err != nil {
		t.Fatal(err)
	}
	fk, err := f.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2, Placement: api.PlacementSpread}, "")
	if err != nil {
		t.Fatalf("fork of a vm with a read-only volume: %v", err)
	}
	for _, ch := range fk.Children {
		vm, err := f.c.Client.GetVM(ctx, ch.ID)
		if err != nil {
			t.Fatal(err)
		}
		if ch.Host != "h1" || len(vm.Volumes) != 1 || vm.Volumes[0].VolumeID != ref.ID || !vm.Volumes[0].ReadOnly {
			t.Fatalf("child %s on %s with volumes %+v, want on h1 sharing volume ref read-only", ch.Name, ch.Host, vm.Volumes)
		}
	}
	var v api.Volume
	if st, e := f.call(t, http.MethodGet, "/v1/volumes/"+ref.ID, nil, &v); st != http.StatusOK || len(v.AttachedTo) != 3 {
		t.Fatalf("shared volume: %d %+v %+v, want attached to the source and both children", st, v, e)
	}
	checkLedger(t, f.c.Store)
}

// A control API that dies (the pass stops dead) between the steps of a
// child of a fork with a volume, then a new one on the same database,
// which resumes the fork: every child has exactly one volume of its own,
// attached, and rows, agents' volumes and allocations agree.
func TestForkWithVolumesCrashBetweenStepsThenRestart(t *testing.T) {
	steps := []struct {
		step string
		slot int
	}{
		{control.ForkStepChildReserved, 1},
		{control.ForkStepChildStart, 1}, // its volume is made and attached; the agent is not asked
		{control.ForkStepChildStarted, 2},
		{control.ForkStepChildRecorded, 0},
	}
	for _, sc := range steps {
		t.Run(fmt.Sprintf("%s/%d", sc.step, sc.slot), func(t *testing.T) {
			eachDatabase(t, func(t *testing.T, dbURL string) {
				ctx := ctxT(t)
				dataDir := ""
				if dbURL == "" {
					dataDir = t.TempDir()
				}
				hooks := &control.Hooks{ForkStep: once(sc.step, sc.slot, control.ErrSimulatedCrash)}
				c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DataDir: dataDir, Hooks: hooks})
				agents := map[string]*testenv.Agent{
					"h1": testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 2048, DiskMiB: 100000}),
					"h2": testenv.StartAgent(t, testenv.AgentOptions{}),
				}
				for _, name := range []string{"h1", "h2"} {
					c.RegisterHost(t, name, agents[name].Address)
				}
				f := volumeFleet{c: c, agents: agents}
				f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 100, Host: "h1"})
				in := smallVM("src")
				in.Volumes = []api.VMVolume{{Volume: "data"}}
				src, err := c.Client.CreateVM(ctx, in, "")
				if err != nil {
					t.Fatal(err)
				}
				if _, err := noRetry(c).CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 3, Placement: api.PlacementColocate}, ""); err == nil {
					t.Fatal("fork with a simulated crash succeeded")
				}
				forks, err := c.Store.UnfinishedForks(ctx, time.Now().Add(time.Minute))
				if err != nil || len(forks) != 1 {
					t.Fatalf("unfinished forks after the crash: %v, %v", forks, err)
				}
				id := forks[0].ID
				c.Stop()
				c = testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DataDir: dataDir})
				f.c = c
				eventually(t, "the restarted control API resumes the fork", func() bool {
					fk, err := c.Client.GetFork(ctx, id)
					return err == nil && fk.Phase == api.ForkReady
				})
				fk, err := c.Client.GetFork(ctx, id)
				if err != nil || len(fk.Children) != 3 {
					t.Fatalf("fork after the resume: %+v, %v", fk, err)
				}
				for _, ch := range fk.Children {
					vm, err := c.Client.GetVM(ctx, ch.ID)
					if err != nil || len(vm.Volumes) != 1 {
						t.Fatalf("child %s: volumes %+v, %v; want one", ch.Name, vm.Volumes, err)
					}
					var v api.Volume
					if st, e := f.call(t, http.MethodGet, "/v1/volumes/"+vm.Volumes[0].VolumeID, nil, &v); st != http.StatusOK ||
						v.Name != "data-"+ch.Name || v.Host != ch.Host || v.State != "ready" {
						t.Fatalf("child %s's volume: %d %+v %+v", ch.Name, st, v, e)
					}
				}
				// Rows and agents agree: one source volume and one per child.
				var list api.List[api.Volume]
				if st, e := f.call(t, http.MethodGet, "/v1/volumes", nil, &list); st != http.StatusOK || len(list.Items) != 4 {
					t.Fatalf("volumes after the resume: %d %+v (%d), want the source's and one per child", st, e, len(list.Items))
				}
				byHost := map[string][]string{}
				for _, v := range list.Items {
					byHost[v.Host] = append(byHost[v.Host], v.ID)
				}
				for name, a := range agents {
					want := byHost[name]
					slices.Sort(want)
					if got := a.VolumeIDs(t); !slices.Equal(got, want) {
						t.Errorf("agent %s has volumes %v, rows say %v", name, got, want)
					}
				}
				checkLedger(t, c.Store)
			})
		})
	}
}
