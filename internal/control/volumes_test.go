package control_test

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// volumeFleet is a control API with sim agents that serve the volume calls.
type volumeFleet struct {
	c      *testenv.Control
	agents map[string]*testenv.Agent
}

func startVolumeFleet(t *testing.T, databaseURL string, hosts map[string]testenv.AgentOptions) volumeFleet {
	t.Helper()
	f := volumeFleet{c: testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL}), agents: map[string]*testenv.Agent{}}
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for k := range hosts {
			if !yield(k) {
				return
			}
		}
	}) {
		opts := hosts[name]
		a := testenv.StartAgent(t, opts)
		f.c.RegisterHost(t, name, a.Address)
		f.agents[name] = a
	}
	return f
}

// call sends one request with the control's admin+user token.
func (f volumeFleet) call(t *testing.T, method, path string, in, out any) (int, api.ErrorDetail) {
	t.Helper()
	return projectCall(t, f.c, f.c.Token, method, path, in, out)
}

func (f volumeFleet) createVolume(t *testing.T, in api.VolumeCreate) api.Volume {
	t.Helper()
	var v api.Volume
	if status, e := f.call(t, http.MethodPost, "/v1/volumes", in, &v); status != http.StatusCreated {
		t.Fatalf("create volume %s: %d %+v", in.Name, status, e)
	}
	return v
}

// fleetState is what a refused request must leave as it was.
type fleetState struct {
	Allocated map[string]api.Resources
	Volumes   []string
	VMs       int
	OnAgents  map[string][]string
	Attached  map[string][]api.VolumeAttachment
}

func (f volumeFleet) state(t *testing.T) fleetState {
	t.Helper()
	ctx := ctxT(t)
	st := fleetState{Allocated: map[string]api.Resources{}, OnAgents: map[string][]string{}, Attached: map[string][]api.VolumeAttachment{}}
	hosts, err := f.c.Client.AllHosts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		st.Allocated[h.Name] = h.Allocated
	}
	var list api.List[api.Volume]
	if status, e := f.call(t, http.MethodGet, "/v1/volumes", nil, &list); status != http.StatusOK {
		t.Fatalf("list volumes: %d %+v", status, e)
	}
	for _, v := range list.Items {
		st.Volumes = append(st.Volumes, v.ID+"/"+v.State+"/"+fmt.Sprint(v.SizeMiB))
		st.Attached[v.ID] = v.AttachedTo
	}
	vms, err := f.c.Store.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	st.VMs = len(vms)
	for name, a := range f.agents {
		st.OnAgents[name] = a.VolumeIDs(t)
	}
	return st
}

// expectRefused sends a request that must be refused with status and
// code and change nothing; it returns the error for further checks.
func (f volumeFleet) expectRefused(t *testing.T, what, method, path string, in any, status int, code string) api.ErrorDetail {
	t.Helper()
	before := f.state(t)
	got, e := f.call(t, method, path, in, nil)
	if got != status || e.Code != code {
		t.Fatalf("%s: got %d %q (%s), want %d %q", what, got, e.Code, e.Message, status, code)
	}
	if e.Message == "" {
		t.Errorf("%s: the error says nothing", what)
	}
	if after := f.state(t); !reflect.DeepEqual(before, after) {
		t.Errorf("%s changed the fleet:\nbefore %+v\nafter  %+v", what, before, after)
	}
	checkLedger(t, f.c.Store)
	return e
}

func TestVolumeLifecycle(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		f := startVolumeFleet(t, databaseURL, map[string]testenv.AgentOptions{"h1": {}, "h2": {}})
		v := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 2048, Labels: map[string]string{"app": "db"}})
		if v.State != api.VolumeReady || v.Host == "" || v.Placement == nil || v.Placement.Host != v.Host {
			t.Fatalf("a placed volume: %+v; want ready, on a host, with its placement", v)
		}
		if v.Serial != agentapi.VolumeSerial(v.ID) || len(v.Serial) != 20 || v.Device != "/dev/disk/by-id/virtio-"+v.Serial {
			t.Errorf("serial %q and device %q of volume %s", v.Serial, v.Device, v.ID)
		}
		if ids := f.agents[v.Host].VolumeIDs(t); !slices.Equal(ids, []string{v.ID}) {
			t.Errorf("agent of %s has volumes %v, want [%s]", v.Host, ids, v.ID)
		}
		if a := hostAllocated(t, f.c, v.Host); a.DiskMiB != 2048 {
			t.Errorf("host %s allocates %d MiB of disk, want the volume's 2048", v.Host, a.DiskMiB)
		}
		for _, ref := range []string{v.ID, "data"} {
			var got api.Volume
			if status, e := f.call(t, http.MethodGet, "/v1/volumes/"+ref, nil, &got); status != http.StatusOK || got.ID != v.ID {
				t.Errorf("get volume by %q: %d %+v %+v", ref, status, e, got)
			}
		}
		clone := f.createVolume(t, api.VolumeCreate{Name: "data-clone", SizeMiB: 4096, Source: &api.VolumeSource{Volume: "data"}})
		if clone.Host != v.Host || clone.Source == nil || clone.Source.Volume != v.ID {
			t.Errorf("a clone of %s (host %s): %+v; want it on its source's host, naming its source", v.ID, v.Host, clone)
		}
		// Paged like the other lists.
		var page api.List[api.Volume]
		if status, e := f.call(t, http.MethodGet, "/v1/volumes?page_size=1", nil, &page); status != http.StatusOK || len(page.Items) != 1 || page.NextPageToken == "" {
			t.Fatalf("first page of 1: %d %+v %+v", status, e, page)
		}
		var rest api.List[api.Volume]
		if status, e := f.call(t, http.MethodGet, "/v1/volumes?page_size=1&page_token="+page.NextPageToken, nil, &rest); status != http.StatusOK || len(rest.Items) != 1 || rest.Items[0].ID == page.Items[0].ID {
			t.Fatalf("second page: %d %+v %+v", status, e, rest)
		}
		// Grow in place; the host counts the growth.
		var grown api.Volume
		if status, e := f.call(t, http.MethodPost, "/v1/volumes/data/resize", api.VolumeResize{SizeMiB: 3072}, &grown); status != http.StatusOK || grown.SizeMiB != 3072 {
			t.Fatalf("grow to 3072: %d %+v %+v", status, e, grown)
		}
		size := int64(5000)
		if status, e := f.call(t, http.MethodPatch, "/v1/volumes/data", api.VolumePatch{SizeMiB: &size}, &grown); status != http.StatusOK || grown.SizeMiB != 5000 {
			t.Fatalf("grow to 5000 by PATCH: %d %+v %+v", status, e, grown)
		}
		checkLedger(t, f.c.Store)
		for _, ref := range []string{"data-clone", v.ID} {
			if status, e := f.call(t, http.MethodDelete, "/v1/volumes/"+ref, nil, nil); status != http.StatusNoContent {
				t.Fatalf("delete %s: %d %+v", ref, status, e)
			}
		}
		if ids := f.agents[v.Host].VolumeIDs(t); len(ids) != 0 {
			t.Errorf("after the deletes the agent still has %v", ids)
		}
		if a := hostAllocated(t, f.c, v.Host); a != (api.Resources{}) {
			t.Errorf("host %s still allocates %+v", v.Host, a)
		}
		if status, _ := f.call(t, http.MethodGet, "/v1/volumes/"+v.ID, nil, nil); status != http.StatusNotFound {
			t.Errorf("a deleted volume answers %d, want 404", status)
		}
	})
}

// Every bad input is a clear 4xx that changes nothing.
func TestVolumeBadInput(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		f := startVolumeFleet(t, databaseURL, map[string]testenv.AgentOptions{
			"h1": {}, "h2": {}, "small": {VCPUs: 4, MemoryMiB: 8192, DiskMiB: 10000},
		})
		ctx := ctxT(t)
		base := f.createVolume(t, api.VolumeCreate{Name: "base", SizeMiB: 1000, Host: "h1"})
		onH2 := f.createVolume(t, api.VolumeCreate{Name: "other", SizeMiB: 100, Host: "h2"})

		post := func(what string, in api.VolumeCreate, status int, code string) api.ErrorDetail {
			t.Helper()
			return f.expectRefused(t, what, http.MethodPost, "/v1/volumes", in, status, code)
		}
		post("size 0", api.VolumeCreate{Name: "x", SizeMiB: 0}, 400, api.CodeInvalid)
		post("no name", api.VolumeCreate{SizeMiB: 10}, 400, api.CodeInvalid)
		post("two sources", api.VolumeCreate{Name: "x", SizeMiB: 10, Source: &api.VolumeSource{Image: "sim", Volume: "base"}}, 400, api.CodeInvalid)
		post("unknown source volume", api.VolumeCreate{Name: "x", SizeMiB: 10, Source: &api.VolumeSource{Volume: "nope"}}, 400, api.CodeInvalid)
		post("unknown source image", api.VolumeCreate{Name: "x", SizeMiB: 10, Source: &api.VolumeSource{Image: "nope"}}, 400, api.CodeInvalid)
		e := post("size below the source's", api.VolumeCreate{Name: "x", SizeMiB: 999, Source: &api.VolumeSource{Volume: "base"}}, 400, api.CodeInvalid)
		if !strings.Contains(e.Message, "1000") {
			t.Errorf("a size below the source's should name the source's size: %q", e.Message)
		}
		e = post("source volume on another host", api.VolumeCreate{Name: "x", SizeMiB: 2000, Host: "h2", Source: &api.VolumeSource{Volume: "base"}}, 400, api.CodeInvalid)
		if !strings.Contains(e.Message, "h1") {
			t.Errorf("a source on another host should name its host: %q", e.Message)
		}
		post("unregistered host", api.VolumeCreate{Name: "x", SizeMiB: 10, Host: "nohost"}, 400, api.CodeInvalid)
		post("name taken", api.VolumeCreate{Name: "base", SizeMiB: 10}, 409, api.CodeConflict)
		e = post("no room on the pinned host", api.VolumeCreate{Name: "x", SizeMiB: 12000, Host: "small"}, 409, api.CodeNoCapacity)
		if e.Details["host"] != "small" || e.Details["shortfall_mib"] != float64(2000) {
			t.Errorf("no_capacity should name the host and the shortfall (12000 asked, 10000 free): %+v", e.Details)
		}
		f.expectRefused(t, "shrink", http.MethodPost, "/v1/volumes/base/resize", api.VolumeResize{SizeMiB: 500}, 400, api.CodeInvalid)
		f.expectRefused(t, "grow past the host", http.MethodPost, "/v1/volumes/other/resize", api.VolumeResize{SizeMiB: 1 << 40}, 409, api.CodeNoCapacity)
		f.expectRefused(t, "unknown volume", http.MethodGet, "/v1/volumes/nope", nil, 404, api.CodeNotFound)
		f.expectRefused(t, "delete unknown volume", http.MethodDelete, "/v1/volumes/nope", nil, 404, api.CodeNotFound)
		f.expectRefused(t, "resize unknown volume", http.MethodPost, "/v1/volumes/nope/resize", api.VolumeResize{SizeMiB: 10}, 404, api.CodeNotFound)
		f.expectRefused(t, "patch unknown volume", http.MethodPatch, "/v1/volumes/"+newUUID(t), api.VolumePatch{Labels: &map[string]string{"a": "b"}}, 404, api.CodeNotFound)
		f.expectRefused(t, "clone of an unknown volume id", http.MethodPost, "/v1/volumes",
			api.VolumeCreate{Name: "x", SizeMiB: 10, Source: &api.VolumeSource{Volume: newUUID(t)}}, 400, api.CodeInvalid)

		vm := func(name string, vols ...api.VMVolume) api.VMCreate {
			in := smallVM(name)
			in.Volumes = vols
			return in
		}
		f.expectRefused(t, "VM with volumes on two hosts", http.MethodPost, "/v1/vms", vm("two", api.VMVolume{Volume: "base"}, api.VMVolume{Volume: onH2.ID}), 400, api.CodeInvalid)
		f.expectRefused(t, "VM with an unknown volume", http.MethodPost, "/v1/vms", vm("unknown", api.VMVolume{Volume: "nope"}), 400, api.CodeInvalid)
		f.expectRefused(t, "VM naming a volume twice", http.MethodPost, "/v1/vms", vm("twice", api.VMVolume{Volume: "base"}, api.VMVolume{Volume: base.ID}), 400, api.CodeInvalid)
		pinned := vm("pinned", api.VMVolume{Volume: "base"})
		pinned.Host = "h2"
		e = f.expectRefused(t, "VM pinned away from its volume", http.MethodPost, "/v1/vms", pinned, 409, api.CodeNoCapacity)
		if !strings.Contains(fmt.Sprint(e.Details["rejected"]), api.ReasonVolume) {
			t.Errorf("a VM pinned away from its volume's host should be rejected for %q: %+v", api.ReasonVolume, e.Details)
		}

		// Attached read-write: a second VM, read-write or read-only, is 409;
		// a delete of the volume is 409 volume_attached naming the VM.
		var owner api.VM
		if status, e := f.call(t, http.MethodPost, "/v1/vms", vm("owner", api.VMVolume{Volume: "base"}), &owner); status != http.StatusCreated {
			t.Fatalf("VM with volume base: %d %+v", status, e)
		}
		if owner.Host != "h1" || len(owner.Volumes) != 1 || owner.Volumes[0].VolumeID != base.ID || owner.Volumes[0].Device != base.Device {
			t.Fatalf("VM with volume base: %+v", owner)
		}
		f.expectRefused(t, "second read-write attach", http.MethodPost, "/v1/vms", vm("thief", api.VMVolume{Volume: "base"}), 409, api.CodeConflict)
		e = f.expectRefused(t, "read-only attach of a read-write volume", http.MethodPost, "/v1/vms", vm("reader", api.VMVolume{Volume: "base", ReadOnly: true}), 409, api.CodeConflict)
		if !strings.Contains(e.Message, owner.ID) {
			t.Errorf("the conflict should name VM %s: %q", owner.ID, e.Message)
		}
		e = f.expectRefused(t, "delete an attached volume", http.MethodDelete, "/v1/volumes/base", nil, 409, api.CodeVolumeAttached)
		if e.Details["vm_id"] != owner.ID || e.Details["volume_id"] != base.ID || !strings.Contains(e.Message, owner.ID) {
			t.Errorf("volume_attached should name VM %s: %+v", owner.ID, e)
		}
		got, err := f.c.Client.GetVM(ctx, owner.ID)
		if err != nil || len(got.Volumes) != 1 || got.Volumes[0].VolumeID != base.ID {
			t.Errorf("GET of VM %s: volumes %+v, %v", owner.ID, got.Volumes, err)
		}
		// Attached read-only: another read-only attach is fine, a
		// read-write one is 409 naming a reader, as is its delete.
		f.createVolume(t, api.VolumeCreate{Name: "shared", SizeMiB: 10, Host: "h1"})
		var reader api.VM
		if status, e := f.call(t, http.MethodPost, "/v1/vms", vm("reader-1", api.VMVolume{Volume: "shared", ReadOnly: true}), &reader); status != http.StatusCreated {
			t.Fatalf("VM with volume shared read-only: %d %+v", status, e)
		}
		e = f.expectRefused(t, "read-write attach of a volume attached read-only", http.MethodPost, "/v1/vms", vm("writer", api.VMVolume{Volume: "shared"}), 409, api.CodeConflict)
		if !strings.Contains(e.Message, reader.ID) {
			t.Errorf("the conflict should name the reader VM %s: %q", reader.ID, e.Message)
		}
		e = f.expectRefused(t, "delete a volume attached read-only", http.MethodDelete, "/v1/volumes/shared", nil, 409, api.CodeVolumeAttached)
		if e.Details["vm_id"] != reader.ID {
			t.Errorf("volume_attached should name VM %s: %+v", reader.ID, e)
		}
		if err := f.c.Client.DeleteVM(ctx, reader.ID); err != nil {
			t.Fatal(err)
		}

		// Another project's volume answers as unknown.
		createProject(t, f.c, api.ProjectCreate{Name: "team-b"})
		tb := projectClient(t, f.c, "team-b")
		if _, err := tb.GetVolume(ctx, base.ID); apiCode(err) != api.CodeNotFound {
			t.Errorf("another project reads volume %s: got %v, want not_found", base.ID, err)
		}
		if err := tb.DeleteVolume(ctx, base.ID); apiCode(err) != api.CodeNotFound {
			t.Errorf("another project deletes volume %s: got %v, want not_found", base.ID, err)
		}
		other := smallVM("b-vm")
		other.Volumes = []api.VMVolume{{Volume: base.ID}}
		if _, err := tb.CreateVM(ctx, other, ""); apiCode(err) != api.CodeInvalid {
			t.Errorf("another project attaches volume %s: got %v, want invalid (unknown volume)", base.ID, err)
		}
		if list, err := tb.ListVolumes(ctx, 0, ""); err != nil || len(list.Items) != 0 {
			t.Errorf("another project lists %d volumes (%v), want none", len(list.Items), err)
		}

		// The VM's delete detaches: the volume can go then.
		if err := f.c.Client.DeleteVM(ctx, owner.ID); err != nil {
			t.Fatal(err)
		}
		if status, e := f.call(t, http.MethodDelete, "/v1/volumes/base", nil, nil); status != http.StatusNoContent {
			t.Fatalf("delete base after its VM went: %d %+v", status, e)
		}
		checkLedger(t, f.c.Store)
	})
}

// A VM naming a volume on host B lands on B although A scores better.
func TestVMIsPlacedOnItsVolumesHost(t *testing.T) {
	f := startVolumeFleet(t, "", map[string]testenv.AgentOptions{
		"a-roomy": {}, "b-tight": {VCPUs: 4, MemoryMiB: 8192, DiskMiB: 20000},
	})
	ctx := ctxT(t)
	free, err := f.c.Client.CreateVM(ctx, smallVM("free"), "")
	if err != nil {
		t.Fatal(err)
	}
	if free.Host != "a-roomy" {
		t.Fatalf("without a volume the VM went to %s; the test needs a-roomy to score better", free.Host)
	}
	f.createVolume(t, api.VolumeCreate{Name: "pg", SizeMiB: 1000, Host: "b-tight"})
	in := smallVM("db")
	in.Volumes = []api.VMVolume{{Volume: "pg"}}
	vm, err := f.c.Client.CreateVM(ctx, in, "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Host != "b-tight" {
		t.Fatalf("a VM naming volume pg (on b-tight) was placed on %s", vm.Host)
	}
	var reasons []string
	if vm.Placement != nil {
		for _, r := range vm.Placement.Rejected {
			reasons = append(reasons, r.Host+":"+r.Reason)
		}
	}
	if !slices.Contains(reasons, "a-roomy:"+api.ReasonVolume) {
		t.Errorf("the placement should say a-roomy was rejected for %q; it says %v", api.ReasonVolume, reasons)
	}
	checkLedger(t, f.c.Store)
}

// A volume create or delete that a replica left half done (killed between
// the reservation and the agent's answer) is settled by the host monitor
// (a create undone, a delete finished): afterwards rows, allocation and
// the agent's volumes agree, and a retry of the create completes.
func TestVolumeStepsLeftByADeadReplicaAreFinished(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, NoMonitor: true})
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", a.Address)
		ctx := context.Background()
		dead := "r-dead-replica"
		// Reserved, never sent to the agent.
		never := store.Volume{ID: "00000000-0000-4000-8000-000000000001", Name: "never", HostName: "h1", SizeMiB: 100, Owner: &dead}
		// Reserved, made on the agent, never marked ready.
		made := store.Volume{ID: "00000000-0000-4000-8000-000000000002", Name: "made", HostName: "h1", SizeMiB: 200, Owner: &dead}
		// Marked deleting, deleted on the agent, never released.
		gone := store.Volume{ID: "00000000-0000-4000-8000-000000000003", Name: "gone", HostName: "h1", SizeMiB: 300, Owner: &dead}
		for _, v := range []store.Volume{never, made, gone} {
			if err := c.Store.ReserveAndInsertVolume(ctx, v); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := a.Client.CreateVolume(ctx, made.ID, agentapi.VolumeSpec{SizeMiB: 200}); err != nil {
			t.Fatal(err)
		}
		if err := c.Store.MarkVolumeReady(ctx, gone.ID); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Store.BeginDeleteVolume(ctx, gone.ID, dead); err != nil {
			t.Fatal(err)
		}
		// A VM reserved with volume "attached" (a ready volume), never sent
		// to its agent.
		attached := store.Volume{ID: "00000000-0000-4000-8000-000000000004", Name: "attached", HostName: "h1", SizeMiB: 50}
		if err := c.Store.ReserveAndInsertVolume(ctx, attached); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Client.CreateVolume(ctx, attached.ID, agentapi.VolumeSpec{SizeMiB: 50}); err != nil {
			t.Fatal(err)
		}
		if err := c.Store.MarkVolumeReady(ctx, attached.ID); err != nil {
			t.Fatal(err)
		}
		vm := store.VM{ID: "01900000-0000-7000-8000-000000000001", Name: "left", HostName: "h1", Image: "sim",
			Resources: store.Resources{VCPUs: 1, MemoryMiB: 64, DiskMiB: 64}, PowerState: api.PowerRunning,
			ObservedState: api.StateCreating, Owner: &dead, Volumes: []store.VMVolume{{VolumeID: attached.ID}}}
		if err := c.Store.ReserveAndInsertVM(ctx, vm); err != nil {
			t.Fatal(err)
		}
		checkLedger(t, c.Store)
		c.Service.SyncNow(ctx)
		if got, err := c.Client.GetVolume(ctx, attached.ID); err != nil || len(got.AttachedTo) != 0 {
			t.Errorf("volume of a VM create left unfinished: %+v, %v; want it detached with the VM's row gone", got, err)
		}
		if _, err := c.Client.GetVM(ctx, vm.ID); apiCode(err) != api.CodeNotFound {
			t.Errorf("VM create left unfinished: %v; want its row gone", err)
		}
		// A create left creating was never acknowledged: it is undone (on
		// the agent too), so its name is free for the caller's retry.
		for _, v := range []store.Volume{never, made} {
			if got, err := c.Client.GetVolume(ctx, v.ID); apiCode(err) != api.CodeNotFound {
				t.Errorf("volume %s left creating: %+v, %v; want it undone (not found)", v.Name, got, err)
			}
		}
		if _, err := c.Client.GetVolume(ctx, gone.ID); apiCode(err) != api.CodeNotFound {
			t.Errorf("volume left deleting: %v; want it gone", err)
		}
		if ids := a.VolumeIDs(t); !slices.Equal(ids, []string{attached.ID}) {
			t.Errorf("agent has %v, want [%s]", ids, attached.ID)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{DiskMiB: 50}) {
			t.Errorf("h1 allocates %+v, want 50 MiB of disk (the one ready volume) and nothing else", got)
		}
		checkLedger(t, c.Store)
		// The second run of the undone creates completes.
		for _, v := range []store.Volume{never, made} {
			if _, err := c.Client.CreateVolume(ctx, api.VolumeCreate{Name: v.Name, SizeMiB: v.SizeMiB, Host: "h1"}); err != nil {
				t.Errorf("retry of the create of volume %s: %v", v.Name, err)
			}
		}
		checkLedger(t, c.Store)
	})
}
