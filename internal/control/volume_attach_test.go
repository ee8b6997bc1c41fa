package control_test

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// attachState is what a refused attach or detach must leave as it was:
// the fleet's rows and allocation, and each VM's volumes as the control
// API and as its agent see them.
type attachState struct {
	Fleet   fleetState
	Rows    map[string][]string // vm -> volume/mode/state
	OnAgent map[string][]string // vm -> volume/mode
}

func (f volumeFleet) attachState(t *testing.T) attachState {
	t.Helper()
	ctx := ctxT(t)
	st := attachState{Fleet: f.state(t), Rows: map[string][]string{}, OnAgent: map[string][]string{}}
	vms, err := f.c.Store.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vm := range vms {
		got, err := f.c.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range got.Volumes {
			st.Rows[vm.ID] = append(st.Rows[vm.ID], fmt.Sprintf("%s/%t/%s", v.VolumeID, v.ReadOnly, v.State))
		}
		onAgent, err := f.agents[vm.HostName].Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range onAgent.Volumes {
			st.OnAgent[vm.ID] = append(st.OnAgent[vm.ID], fmt.Sprintf("%s/%t", v.ID, v.ReadOnly))
		}
		slices.Sort(st.Rows[vm.ID])
		slices.Sort(st.OnAgent[vm.ID])
	}
	return st
}

// agree checks that every VM's attachment rows are settled and match what
// its agent has.
func (s attachState) agree(t *testing.T) {
	t.Helper()
	for vm, rows := range s.Rows {
		var want []string
		for _, r := range rows {
			if !strings.HasSuffix(r, "/"+api.AttachmentAttached) {
				t.Errorf("vm %s has an unsettled attachment %s", vm, r)
			}
			want = append(want, strings.TrimSuffix(r, "/"+api.AttachmentAttached))
		}
		if !slices.Equal(want, s.OnAgent[vm]) {
			t.Errorf("vm %s: rows %v, agent %v", vm, rows, s.OnAgent[vm])
		}
	}
	for vm, vols := range s.OnAgent {
		if len(vols) > 0 && len(s.Rows[vm]) == 0 {
			t.Errorf("vm %s: the agent has volumes %v that no row claims", vm, vols)
		}
	}
}

// refuseAttach sends a request that must be refused with status and code
// and change nothing: rows, allocation, and the agents' attachments.
func (f volumeFleet) refuseAttach(t *testing.T, what, method, path string, in any, status int, code string) api.ErrorDetail {
	t.Helper()
	before := f.attachState(t)
	got, e := f.call(t, method, path, in, nil)
	if got != status || e.Code != code {
		t.Fatalf("%s: got %d %q (%s), want %d %q", what, got, e.Code, e.Message, status, code)
	}
	if e.Message == "" {
		t.Errorf("%s: the error says nothing", what)
	}
	if after := f.attachState(t); !reflect.DeepEqual(before, after) {
		t.Errorf("%s changed the fleet:\nbefore %+v\nafter  %+v", what, before, after)
	}
	checkLedger(t, f.c.Store)
	return e
}

func (f volumeFleet) attach(t *testing.T, vm, volume string, readOnly bool) api.VM {
	t.Helper()
	var out api.VM
	if status, e := f.call(t, http.MethodPost, "/v1/vms/"+vm+"/volumes", api.VMVolumeAttach{Volume: volume, ReadOnly: readOnly}, &out); status != http.StatusOK {
		t.Fatalf("attach %s to %s: %d %+v", volume, vm, status, e)
	}
	return out
}

func (f volumeFleet) detach(t *testing.T, vm, volume string) {
	t.Helper()
	if status, e := f.call(t, http.MethodDelete, "/v1/vms/"+vm+"/volumes/"+volume, nil, nil); status != http.StatusNoContent {
		t.Fatalf("detach %s from %s: %d %+v", volume, vm, status, e)
	}
}

func vmHas(vm api.VM, volID string, readOnly bool) bool {
	return slices.ContainsFunc(vm.Volumes, func(v api.VMVolume) bool {
		return v.VolumeID == volID && v.ReadOnly == readOnly && v.State == api.AttachmentAttached
	})
}

// Hot attach and detach through the control API, with sim agents: the
// answer is the VM with its volumes, the agent has what the rows say, a
// stopped VM keeps an attachment for its next start, and attaching again
// or detaching what is not attached changes nothing.
func TestVolumeHotAttachLifecycle(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		f := startVolumeFleet(t, databaseURL, map[string]testenv.AgentOptions{"h1": {}})
		ctx := ctxT(t)
		in := smallVM("app")
		app, err := f.c.Client.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		data := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 100, Host: "h1"})
		shared := f.createVolume(t, api.VolumeCreate{Name: "shared", SizeMiB: 100, Host: "h1"})

		got := f.attach(t, app.ID, "data", false)
		if got.ID != app.ID || !vmHas(got, data.ID, false) || got.Volumes[0].Serial != data.Serial || got.Volumes[0].Device != data.Device {
			t.Fatalf("attach by name answered %+v; want VM %s with volume %s read-write, serial %s", got.Volumes, app.ID, data.ID, data.Serial)
		}
		before := f.attachState(t)
		before.agree(t)
		if again := f.attach(t, app.ID, data.ID, false); !reflect.DeepEqual(again.Volumes, got.Volumes) {
			t.Errorf("attaching again by id answered %+v, want %+v", again.Volumes, got.Volumes)
		}
		if after := f.attachState(t); !reflect.DeepEqual(before, after) {
			t.Errorf("attaching again changed the fleet:\nbefore %+v\nafter  %+v", before, after)
		}
		v, err := f.c.Client.GetVolume(ctx, "data")
		if err != nil || len(v.AttachedTo) != 1 || v.AttachedTo[0].VMID != app.ID || v.AttachedTo[0].State != api.AttachmentAttached {
			t.Errorf("volume data: attached_to %+v (%v), want VM %s attached", v.AttachedTo, err, app.ID)
		}

		// Read-only: two VMs share it.
		other, err := f.c.Client.CreateVM(ctx, smallVM("other"), "")
		if err != nil {
			t.Fatal(err)
		}
		f.attach(t, app.ID, "shared", true)
		if got := f.attach(t, other.ID, "shared", true); !vmHas(got, shared.ID, true) {
			t.Errorf("second read-only attach: %+v", got.Volumes)
		}
		f.attachState(t).agree(t)

		// A stopped VM records it; it has it when it starts again.
		stopped, running := api.PowerStopped, api.PowerRunning
		if _, err := f.c.Client.UpdateVM(ctx, other.ID, api.VMPatch{PowerState: &stopped}); err != nil {
			t.Fatal(err)
		}
		cold := f.createVolume(t, api.VolumeCreate{Name: "cold", SizeMiB: 50, Host: "h1"})
		if got := f.attach(t, other.ID, "cold", false); !vmHas(got, cold.ID, false) || got.PowerState != api.PowerStopped {
			t.Errorf("attach to a stopped VM: %+v (power %s)", got.Volumes, got.PowerState)
		}
		if _, err := f.c.Client.UpdateVM(ctx, other.ID, api.VMPatch{PowerState: &running}); err != nil {
			t.Fatal(err)
		}
		onAgent, err := f.agents["h1"].Client.GetVM(ctx, other.ID)
		if err != nil || onAgent.State != "running" || !slices.ContainsFunc(onAgent.Volumes, func(a agentapi.VolumeAttachment) bool { return a.ID == cold.ID }) {
			t.Errorf("started VM on the agent: %+v (%v); want running with volume %s", onAgent, err, cold.ID)
		}
		f.attachState(t).agree(t)

		// Detach: gone from the agent and the rows; the volume is free for
		// another VM read-write.
		f.detach(t, app.ID, "data")
		st := f.attachState(t)
		st.agree(t)
		if slices.ContainsFunc(st.OnAgent[app.ID], func(s string) bool { return strings.HasPrefix(s, data.ID) }) {
			t.Errorf("the agent still has volume data on %s: %v", app.ID, st.OnAgent[app.ID])
		}
		if got := f.attach(t, other.ID, data.ID, false); !vmHas(got, data.ID, false) {
			t.Errorf("read-write attach after the detach: %+v", got.Volumes)
		}
		// Detaching what is not attached: 204, nothing changes.
		before = f.attachState(t)
		f.detach(t, app.ID, "data")
		if after := f.attachState(t); !reflect.DeepEqual(before, after) {
			t.Errorf("detaching a volume that is not attached changed the fleet:\nbefore %+v\nafter  %+v", before, after)
		}
		f.attachState(t).agree(t)
		checkLedger(t, f.c.Store)

		// Detached everywhere, the volume can be deleted.
		f.detach(t, other.ID, "cold")
		if err := f.c.Client.DeleteVolume(ctx, "cold"); err != nil {
			t.Errorf("delete a detached volume: %v", err)
		}
		checkLedger(t, f.c.Store)
	})
}

// Every bad attach or detach is a clear 4xx and changes nothing: not the
// rows, not the allocation, not what the agents have.
func TestVolumeHotAttachBadInput(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		f := startVolumeFleet(t, databaseURL, map[string]testenv.AgentOptions{"h1": {}, "h2": {}})
		ctx := ctxT(t)
		pin := func(name string) api.VM {
			in := smallVM(name)
			in.Host = "h1"
			vm, err := f.c.Client.CreateVM(ctx, in, "")
			if err != nil {
				t.Fatal(err)
			}
			return vm
		}
		app, thief := pin("app"), pin("thief")
		data := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 100, Host: "h1"})
		far := f.createVolume(t, api.VolumeCreate{Name: "far", SizeMiB: 100, Host: "h2"})
		f.attach(t, app.ID, "data", false)
		path := "/v1/vms/" + app.ID + "/volumes"

		e := f.refuseAttach(t, "a volume of another host", http.MethodPost, path, api.VMVolumeAttach{Volume: "far"}, 400, api.CodeInvalid)
		if !strings.Contains(e.Message, "h1") || !strings.Contains(e.Message, "h2") || !strings.Contains(e.Message, "move") ||
			e.Details["volume_host"] != "h2" || e.Details["vm_host"] != "h1" {
			t.Errorf("another host's volume should name both hosts and say to move it: %+v", e)
		}
		f.refuseAttach(t, "no volume", http.MethodPost, path, api.VMVolumeAttach{}, 400, api.CodeInvalid)
		f.refuseAttach(t, "an unknown volume", http.MethodPost, path, api.VMVolumeAttach{Volume: "nope"}, 404, api.CodeNotFound)
		f.refuseAttach(t, "an unknown VM", http.MethodPost, "/v1/vms/01900000-0000-7000-8000-00000000ffff/volumes", api.VMVolumeAttach{Volume: "data"}, 404, api.CodeNotFound)
		e = f.refuseAttach(t, "read-write to a second VM", http.MethodPost, "/v1/vms/"+thief.ID+"/volumes", api.VMVolumeAttach{Volume: "data"}, 409, api.CodeVolumeAttached)
		if e.Details["vm_id"] != app.ID || !strings.Contains(e.Message, app.ID) {
			t.Errorf("volume_attached should name VM %s: %+v", app.ID, e)
		}
		f.refuseAttach(t, "read-only to a second VM while one has it read-write", http.MethodPost, "/v1/vms/"+thief.ID+"/volumes",
			api.VMVolumeAttach{Volume: "data", ReadOnly: true}, 409, api.CodeVolumeAttached)
		e = f.refuseAttach(t, "the same VM in the other mode", http.MethodPost, path, api.VMVolumeAttach{Volume: "data", ReadOnly: true}, 409, api.CodeConflict)
		if !strings.Contains(e.Message, "detach") {
			t.Errorf("a mode change should say to detach first: %q", e.Message)
		}
		f.refuseAttach(t, "detach of an unknown volume", http.MethodDelete, path+"/nope", nil, 404, api.CodeNotFound)
		f.refuseAttach(t, "detach from an unknown VM", http.MethodDelete, "/v1/vms/01900000-0000-7000-8000-00000000ffff/volumes/data", nil, 404, api.CodeNotFound)
		f.refuseAttach(t, "delete an attached volume", http.MethodDelete, "/v1/volumes/data", nil, 409, api.CodeVolumeAttached)

		// Another project: its VM cannot take this project's volume, by id
		// or name, and it cannot detach it; both answer as unknown.
		createProject(t, f.c, api.ProjectCreate{Name: "team-b"})
		tb := projectClient(t, f.c, "team-b")
		in := smallVM("b-vm")
		in.Host = "h1"
		bvm, err := tb.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, ref := range []string{data.ID, "data", far.ID} {
			before := f.attachState(t)
			if _, err := tb.AttachVolume(ctx, bvm.ID, api.VMVolumeAttach{Volume: ref}); apiCode(err) != api.CodeNotFound {
				t.Errorf("project team-b attaches %s: %v, want not_found", ref, err)
			}
			if err := tb.DetachVolume(ctx, app.ID, ref); apiCode(err) != api.CodeNotFound {
				t.Errorf("project team-b detaches %s from another project's VM: %v, want not_found", ref, err)
			}
			if after := f.attachState(t); !reflect.DeepEqual(before, after) {
				t.Errorf("another project's attach of %s changed the fleet", ref)
			}
		}
		if _, err := tb.AttachVolume(ctx, app.ID, api.VMVolumeAttach{Volume: "data"}); apiCode(err) != api.CodeNotFound {
			t.Errorf("project team-b attaches to another project's VM: %v, want not_found", err)
		}

		// At most 8 per VM.
		for i := range api.MaxVMVolumes - 1 {
			f.createVolume(t, api.VolumeCreate{Name: fmt.Sprintf("v%d", i), SizeMiB: 10, Host: "h1"})
			f.attach(t, app.ID, fmt.Sprintf("v%d", i), false)
		}
		f.createVolume(t, api.VolumeCreate{Name: "ninth", SizeMiB: 10, Host: "h1"})
		e = f.refuseAttach(t, "a ninth volume", http.MethodPost, path, api.VMVolumeAttach{Volume: "ninth"}, 400, api.CodeInvalid)
		if e.Details["max_volumes"] != float64(api.MaxVMVolumes) || !strings.Contains(e.Message, "detach one") {
			t.Errorf("a ninth volume should say the most is %d and to detach one: %+v", api.MaxVMVolumes, e)
		}
		f.attachState(t).agree(t)
		checkLedger(t, f.c.Store)
	})
}

// An attach or detach that a replica left half done (killed between its
// row and the agent's answer) is settled by the host monitor against the
// agent's view of the VM: finished when the agent has the volume, undone
// when it does not; a detach is finished.
func TestVolumeAttachStepsLeftByADeadReplicaAreSettled(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, NoMonitor: true})
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", a.Address)
		f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a}}
		ctx := context.Background()
		vm, err := c.Client.CreateVM(ctx, smallVM("app"), "")
		if err != nil {
			t.Fatal(err)
		}
		vol := map[string]api.Volume{}
		for _, name := range []string{"never", "made", "half-detached", "detached"} {
			vol[name] = f.createVolume(t, api.VolumeCreate{Name: name, SizeMiB: 10, Host: "h1"})
		}
		dead := "r-dead-replica"
		// Claimed, never sent to the agent.
		if _, err := c.Store.BeginAttach(ctx, vm.ID, vol["never"].ID, false, dead, api.MaxVMVolumes); err != nil {
			t.Fatal(err)
		}
		// Claimed, attached on the agent, never marked attached.
		if _, err := c.Store.BeginAttach(ctx, vm.ID, vol["made"].ID, true, dead, api.MaxVMVolumes); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Client.AttachVolume(ctx, vm.ID, vol["made"].ID, true); err != nil {
			t.Fatal(err)
		}
		// Attached, marked detaching, never sent to the agent.
		f.attach(t, vm.ID, "half-detached", false)
		if _, err := c.Store.BeginDetach(ctx, vm.ID, vol["half-detached"].ID, dead); err != nil {
			t.Fatal(err)
		}
		// Attached, marked detaching, detached on the agent, never removed.
		f.attach(t, vm.ID, "detached", false)
		if _, err := c.Store.BeginDetach(ctx, vm.ID, vol["detached"].ID, dead); err != nil {
			t.Fatal(err)
		}
		if err := a.Client.DetachVolume(ctx, vm.ID, vol["detached"].ID); err != nil {
			t.Fatal(err)
		}
		// While unsettled, a new attach or detach of the same pair is 409.
		if _, err := c.Client.AttachVolume(ctx, vm.ID, api.VMVolumeAttach{Volume: "never"}); apiCode(err) != api.CodeConflict {
			t.Errorf("attach while an attach is unsettled: %v, want conflict", err)
		}
		if err := c.Client.DetachVolume(ctx, vm.ID, "made"); apiCode(err) != api.CodeConflict {
			t.Errorf("detach while an attach is unsettled: %v, want conflict", err)
		}

		c.Service.SyncNow(ctx)
		st := f.attachState(t)
		st.agree(t)
		want := []string{vol["made"].ID + "/true/" + api.AttachmentAttached}
		if !slices.Equal(st.Rows[vm.ID], want) {
			t.Errorf("vm %s settled to %v, want %v", vm.ID, st.Rows[vm.ID], want)
		}
		for _, name := range []string{"never", "half-detached", "detached"} {
			v, err := c.Client.GetVolume(ctx, name)
			if err != nil || len(v.AttachedTo) != 0 {
				t.Errorf("volume %s: attached_to %+v (%v), want none", name, v.AttachedTo, err)
			}
			// Free again: another VM can take it read-write.
			if err := c.Client.DeleteVolume(ctx, name); err != nil {
				t.Errorf("delete settled volume %s: %v", name, err)
			}
		}
		checkLedger(t, c.Store)
	})
}

// Concurrent attaches: of one volume read-write to several VMs, exactly
// one wins and the others are 409 volume_attached; of more volumes than a
// VM can have to one VM, exactly the most it can have win and the rest
// are 400. Afterwards rows and agent agree.
func TestVolumeHotAttachConcurrent(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		f := startVolumeFleet(t, databaseURL, map[string]testenv.AgentOptions{"h1": {}})
		ctx := ctxT(t)
		const racers = api.MaxVMVolumes + 2
		var vms []api.VM
		for i := range racers {
			vm, err := f.c.Client.CreateVM(ctx, smallVM(fmt.Sprintf("vm-%d", i)), "")
			if err != nil {
				t.Fatal(err)
			}
			vms = append(vms, vm)
		}
		f.createVolume(t, api.VolumeCreate{Name: "contended", SizeMiB: 10, Host: "h1"})
		for i := range racers {
			f.createVolume(t, api.VolumeCreate{Name: fmt.Sprintf("v%d", i), SizeMiB: 10, Host: "h1"})
		}
		race := func(call func(i int) error) map[string]int {
			codes := make([]string, racers)
			var wg sync.WaitGroup
			for i := range racers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := call(i); err != nil {
						codes[i] = apiCode(err)
						if codes[i] == "" {
							codes[i] = err.Error()
						}
					} else {
						codes[i] = "ok"
					}
				}()
			}
			wg.Wait()
			out := map[string]int{}
			for _, c := range codes {
				out[c]++
			}
			return out
		}
		c := noRetry(f.c)
		got := race(func(i int) error {
			_, err := c.AttachVolume(ctx, vms[i].ID, api.VMVolumeAttach{Volume: "contended"})
			return err
		})
		if got["ok"] != 1 || got[api.CodeVolumeAttached] != racers-1 {
			t.Errorf("%d VMs raced for one volume read-write: %v; want 1 ok and %d volume_attached", racers, got, racers-1)
		}
		count := func() int {
			vm, err := f.c.Client.GetVM(ctx, vms[0].ID)
			if err != nil {
				t.Fatal(err)
			}
			return len(vm.Volumes)
		}
		room := api.MaxVMVolumes - count()
		got = race(func(i int) error {
			_, err := c.AttachVolume(ctx, vms[0].ID, api.VMVolumeAttach{Volume: fmt.Sprintf("v%d", i)})
			return err
		})
		if got["ok"] != room || got[api.CodeInvalid] != racers-room || count() != api.MaxVMVolumes {
			t.Errorf("%d volumes raced onto a VM with room for %d: %v, it has %d; want %d ok, the rest invalid, and %d volumes",
				racers, room, got, count(), room, api.MaxVMVolumes)
		}
		f.attachState(t).agree(t)
		checkLedger(t, f.c.Store)
	})
}
