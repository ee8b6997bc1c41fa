package control_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// simVolumeFile is the file of volume id on a sim agent.
func simVolumeFile(a *testenv.Agent, id string) string {
	return filepath.Join(a.StateDir, "volumes", id, "disk.qcow2")
}

// writeMarker writes kvm-marker:<id> at the start of volume id's file on a
// sim agent and returns the file's sha256.
func writeMarker(t *testing.T, a *testenv.Agent, id string) string {
	t.Helper()
	f, err := os.OpenFile(simVolumeFile(a, id), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("kvm-marker:"+id), 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return fileSHA256(t, simVolumeFile(a, id))
}

func fileSHA256(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// checkMovedTo asserts that volume v is ready on host to with its content
// (digest), and that no other agent of f has it.
func checkMovedTo(t *testing.T, f volumeFleet, v api.Volume, to, digest string) {
	t.Helper()
	got, err := f.c.Client.GetVolume(ctxT(t), v.ID)
	if err != nil || got.Host != to || got.State != api.VolumeReady || got.Reason != "" {
		t.Fatalf("volume %s after the move: %+v, %v; want ready on %s", v.Name, got, err, to)
	}
	for name, a := range f.agents {
		has := slices.Contains(a.VolumeIDs(t), v.ID)
		_, statErr := os.Stat(filepath.Dir(simVolumeFile(a, v.ID)))
		switch {
		case name == to && !has:
			t.Errorf("host %s (the target) does not have volume %s", name, v.ID)
		case name == to && fileSHA256(t, simVolumeFile(a, v.ID)) != digest:
			t.Errorf("the copy of volume %s on %s has sha256 %s, the source's had %s", v.ID, name, fileSHA256(t, simVolumeFile(a, v.ID)), digest)
		case name != to && (has || statErr == nil):
			t.Errorf("host %s still has volume %s (listed %v, directory %v)", name, v.ID, has, statErr)
		}
	}
	checkLedger(t, f.c.Store)
}

// A detached volume moves between two agents: the target's copy has the
// source's content (the marker, the same sha256), the source's copy is
// gone, the allocations follow, and a VM created with the volume lands on
// the new host. Then the bad inputs, each a clear 4xx that changes nothing.
func TestVolumeMove(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		f := startVolumeFleet(t, databaseURL, map[string]testenv.AgentOptions{
			"h1": {}, "h2": {}, "small": {VCPUs: 4, MemoryMiB: 8192, DiskMiB: 10000}, "closed": {},
		})
		ctx := ctxT(t)
		v := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
		digest := writeMarker(t, f.agents["h1"], v.ID)

		var moved api.Volume
		if status, e := f.call(t, http.MethodPost, "/v1/volumes/data/move", api.VolumeMove{Host: "h2"}, &moved); status != http.StatusOK {
			t.Fatalf("move volume data to h2: %d %+v", status, e)
		}
		if moved.Host != "h2" || moved.State != api.VolumeReady || moved.ID != v.ID {
			t.Fatalf("the move answered %+v; want volume %s ready on h2", moved, v.ID)
		}
		checkMovedTo(t, f, v, "h2", digest)
		b, err := os.ReadFile(simVolumeFile(f.agents["h2"], v.ID))
		if err != nil || !bytes.HasPrefix(b, []byte("kvm-marker:"+v.ID)) {
			t.Fatalf("the moved volume does not start with its marker (%v)", err)
		}
		if got := hostAllocated(t, f.c, "h1"); got.DiskMiB != 0 {
			t.Errorf("h1 still allocates %d MiB of disk after the volume left", got.DiskMiB)
		}
		if got := hostAllocated(t, f.c, "h2"); got.DiskMiB != 8 {
			t.Errorf("h2 allocates %d MiB of disk, want the volume's 8", got.DiskMiB)
		}

		// The same host: a no-op.
		before := f.state(t)
		if status, e := f.call(t, http.MethodPost, "/v1/volumes/"+v.ID+"/move", api.VolumeMove{Host: "h2"}, &moved); status != http.StatusOK || moved.Host != "h2" {
			t.Fatalf("move to the host it is on: %d %+v %+v; want 200 on h2", status, e, moved)
		}
		if after := f.state(t); fmt.Sprint(before) != fmt.Sprint(after) {
			t.Errorf("a move to the same host changed the fleet:\n%+v\n%+v", before, after)
		}

		// A VM with the volume goes to its new host.
		in := smallVM("db")
		in.Volumes = []api.VMVolume{{Volume: "data"}}
		vm, err := f.c.Client.CreateVM(ctx, in, "")
		if err != nil || vm.Host != "h2" {
			t.Fatalf("VM with the moved volume: %+v, %v; want it on h2", vm, err)
		}

		// Bad input.
		move := func(what, ref, host string, status int, code string) api.ErrorDetail {
			t.Helper()
			return f.expectRefused(t, what, http.MethodPost, "/v1/volumes/"+ref+"/move", api.VolumeMove{Host: host}, status, code)
		}
		e := move("attached volume", "data", "h1", 409, api.CodeVolumeAttached)
		if e.Details["vm_id"] != vm.ID || !strings.Contains(e.Message, vm.ID) || !strings.Contains(e.Message, "detach") {
			t.Errorf("volume_attached should name VM %s and say to detach: %+v", vm.ID, e)
		}
		other := f.createVolume(t, api.VolumeCreate{Name: "other", SizeMiB: 12000, Host: "h1"})
		move("unknown volume", "nope", "h2", 404, api.CodeNotFound)
		move("no host", "other", "", 400, api.CodeInvalid)
		move("unknown host", "other", "nohost", 400, api.CodeInvalid)
		e = move("no room on the target", "other", "small", 409, api.CodeNoCapacity)
		if e.Details["host"] != "small" || e.Details["shortfall_mib"] != float64(2000) {
			t.Errorf("no_capacity should name the host and the shortfall (12000 asked, 10000 free): %+v", e.Details)
		}
		if _, err := f.c.Client.PutHost(ctx, "closed", api.HostPut{Address: f.agents["closed"].Address, Schedulable: ptrTo(false)}); err != nil {
			t.Fatal(err)
		}
		e = move("cordoned host", "other", "closed", 409, api.CodeConflict)
		if !strings.Contains(e.Message, "cordoned") {
			t.Errorf("a move to a cordoned host should say so: %q", e.Message)
		}
		if got, err := f.c.Client.GetVolume(ctx, other.ID); err != nil || got.Host != "h1" || got.State != api.VolumeReady {
			t.Errorf("volume other after the refused moves: %+v, %v", got, err)
		}
		checkLedger(t, f.c.Store)
	})
}

func ptrTo[T any](v T) *T { return &v }

// A retired host takes no volume.
func TestVolumeMoveToRetiredHost(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{DeadAfter: 1})
	a1 := testenv.StartAgent(t, testenv.AgentOptions{})
	gone := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h1", a1.Address)
	c.RegisterHost(t, "gone", gone.Address)
	f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a1}}
	v := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
	gone.Stop()
	eventually(t, "host gone marked not alive", func() bool {
		h, err := c.Client.GetHost(ctx, "gone")
		return err == nil && !h.Alive
	})
	if _, err := c.Client.RetireHost(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	e := f.expectRefused(t, "retired host", http.MethodPost, "/v1/volumes/"+v.ID+"/move", api.VolumeMove{Host: "gone"}, 409, api.CodeConflict)
	if !strings.Contains(e.Message, "retired") {
		t.Errorf("a move to a retired host should say so: %q", e.Message)
	}
}

// tamperProxy sits in front of an agent and flips a byte of every volume
// content it passes (GET /v1/volumes/{id}/content), keeping the agent's
// digest header: what a peer that alters the bytes sends.
func tamperProxy(t *testing.T, agentURL string) string {
	t.Helper()
	target, err := url.Parse(agentURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.ModifyResponse = func(resp *http.Response) error {
		if !strings.HasSuffix(resp.Request.URL.Path, "/content") || resp.StatusCode != http.StatusOK {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		if len(b) > 100 {
			b[100] ^= 0xff
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return nil
	}
	srv := httptest.NewServer(proxy)
	t.Cleanup(srv.Close)
	return srv.URL
}

// A tampered transfer is refused: the source's host answers with altered
// bytes under the right digest; the target's pull checks the digest while
// it streams and refuses it. The move fails cleanly: the volume stays
// ready on its source with its content, the target's reservation is
// released and the target has nothing of it.
func TestVolumeMoveRefusesATamperedTransfer(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL})
		a1 := testenv.StartAgent(t, testenv.AgentOptions{})
		a2 := testenv.StartAgent(t, testenv.AgentOptions{})
		evil := tamperProxy(t, a1.URL)
		a1.AllowAddress(t, evil)
		c.RegisterHost(t, "h1", evil)
		c.RegisterHost(t, "h2", a2.Address)
		f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a1, "h2": a2}}
		v := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
		digest := writeMarker(t, a1, v.ID)
		e := f.expectRefused(t, "tampered transfer", http.MethodPost, "/v1/volumes/data/move", api.VolumeMove{Host: "h2"}, 503, api.CodeUnavailable)
		if !strings.Contains(e.Message, "sha256") {
			t.Errorf("the refused move should say the digest did not match: %q", e.Message)
		}
		if ids := a2.VolumeIDs(t); len(ids) != 0 {
			t.Errorf("the target kept %v after a refused transfer", ids)
		}
		entries, _ := os.ReadDir(filepath.Join(a2.StateDir, "volumes"))
		for _, en := range entries {
			if strings.Contains(en.Name(), v.ID) {
				t.Errorf("the target has %s of the refused volume", en.Name())
			}
		}
		if got := hostAllocated(t, c, "h2"); got.DiskMiB != 0 {
			t.Errorf("h2 allocates %d MiB after the refused move, want 0", got.DiskMiB)
		}
		if fileSHA256(t, simVolumeFile(a1, v.ID)) != digest {
			t.Error("the source's copy changed")
		}
	})
}

// The control plane dies (simulated: the move stops on the spot with no
// cleanup) after each step of a move; the host monitor then finishes the
// move when the target has the complete copy and undoes it otherwise.
// Rows, both hosts' allocations and the agents' files agree afterwards.
func TestVolumeMoveStopsAtEachStep(t *testing.T) {
	for _, tc := range []struct {
		step     string
		finished bool
	}{
		{control.MoveStepReserved, false},
		{control.MoveStepDigest, false},
		{control.MoveStepCopied, true},
		{control.MoveStepSwitched, true},
	} {
		t.Run(tc.step, func(t *testing.T) {
			eachDatabase(t, func(t *testing.T, databaseURL string) {
				crash := errors.New("killed at " + tc.step)
				c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, NoMonitor: true, Hooks: &control.Hooks{
					VolumeMoveStep: func(_ context.Context, _, step string) error {
						if step == tc.step {
							return crash
						}
						return nil
					}}})
				a1 := testenv.StartAgent(t, testenv.AgentOptions{})
				a2 := testenv.StartAgent(t, testenv.AgentOptions{})
				c.RegisterHost(t, "h1", a1.Address)
				c.RegisterHost(t, "h2", a2.Address)
				ctx := ctxT(t)
				c.Service.SyncNow(ctx)
				f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a1, "h2": a2}}
				v := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
				digest := writeMarker(t, a1, v.ID)
				if _, err := noRetry(c).MoveVolume(ctx, v.ID, "h2"); err == nil {
					t.Fatal("the move answered success although it stopped")
				}
				got, err := c.Client.GetVolume(ctx, v.ID)
				if err != nil || got.State != api.VolumeMoving {
					t.Fatalf("after a stop at %s the volume is %+v (%v); want moving", tc.step, got, err)
				}
				if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "x", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64,
					Volumes: []api.VMVolume{{Volume: v.ID}}}, ""); apiCode(err) != api.CodeConflict {
					t.Errorf("attach of a moving volume: %v; want 409", err)
				}
				if err := c.Client.DeleteVolume(ctx, v.ID); apiCode(err) != api.CodeConflict {
					t.Errorf("delete of a moving volume: %v; want 409", err)
				}
				checkLedger(t, c.Store)
				c.Service.SyncNow(ctx)
				want := "h1"
				if tc.finished {
					want = "h2"
				}
				checkMovedTo(t, f, v, want, digest)
				if hostAllocated(t, c, want).DiskMiB != 8 || hostAllocated(t, c, map[string]string{"h1": "h2", "h2": "h1"}[want]).DiskMiB != 0 {
					t.Errorf("allocations after the settle: h1 %+v h2 %+v", hostAllocated(t, c, "h1"), hostAllocated(t, c, "h2"))
				}
			})
		})
	}
}

// A move whose replica died (its lease lapsed) is settled by another
// replica's host monitor: rows left in each phase by a dead owner.
func TestVolumeMoveLeftByADeadReplica(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, NoMonitor: true})
		a1 := testenv.StartAgent(t, testenv.AgentOptions{})
		a2 := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", a1.Address)
		c.RegisterHost(t, "h2", a2.Address)
		ctx := ctxT(t)
		c.Service.SyncNow(ctx)
		f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a1, "h2": a2}}
		dead := "r-dead-replica"
		// Reserved on h2, the target never asked.
		never := f.createVolume(t, api.VolumeCreate{Name: "never", SizeMiB: 8, Host: "h1"})
		if _, err := c.Store.BeginMoveVolume(ctx, never.ID, "h2", dead); err != nil {
			t.Fatal(err)
		}
		// Copied to h2 with a digest that is not the source's: a stale copy.
		stale := f.createVolume(t, api.VolumeCreate{Name: "stale", SizeMiB: 8, Host: "h1"})
		if _, err := c.Store.BeginMoveVolume(ctx, stale.ID, "h2", dead); err != nil {
			t.Fatal(err)
		}
		if err := c.Store.RecordMoveDigest(ctx, stale.ID, "h2", strings.Repeat("0", 64)); err != nil {
			t.Fatal(err)
		}
		if _, err := a2.Client.CreateVolume(ctx, stale.ID, peerSpec(a1, "")); err != nil {
			t.Fatal(err)
		}
		// Switched to h2, the old copy on h1 never deleted.
		switched := f.createVolume(t, api.VolumeCreate{Name: "switched", SizeMiB: 8, Host: "h1"})
		digest := writeMarker(t, a1, switched.ID)
		if _, err := c.Store.BeginMoveVolume(ctx, switched.ID, "h2", dead); err != nil {
			t.Fatal(err)
		}
		if _, err := a2.Client.CreateVolume(ctx, switched.ID, peerSpec(a1, digest)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Store.SwitchVolumeHost(ctx, switched.ID, "h2", "moving"); err != nil {
			t.Fatal(err)
		}
		checkLedger(t, c.Store)
		c.Service.SyncNow(ctx)
		checkMovedTo(t, f, never, "h1", fileSHA256(t, simVolumeFile(a1, never.ID)))
		checkMovedTo(t, f, stale, "h1", fileSHA256(t, simVolumeFile(a1, stale.ID)))
		checkMovedTo(t, f, switched, "h2", digest)
		if got := hostAllocated(t, c, "h1"); got.DiskMiB != 16 {
			t.Errorf("h1 allocates %d MiB, want 16 (never and stale)", got.DiskMiB)
		}
	})
}

// peerSpec is the agent spec of a pull of an 8 MiB volume from agent a.
func peerSpec(a *testenv.Agent, digest string) agentapi.VolumeSpec {
	return agentapi.VolumeSpec{SizeMiB: 8, Source: &agentapi.VolumeSource{Peer: &agentapi.VolumePeer{
		Agent: a.Address, PublicKey: agentapi.EncodeKey(a.PublicKey), Digest: digest}}}
}

// The new host loses its copy after the switch (deleted behind the
// control plane's back) while the old copy is still there: the host
// monitor takes the switch back and undoes the move instead of deleting
// the only copy left.
func TestVolumeMoveKeepsTheOldCopyWhenTheNewOneIsLost(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, NoMonitor: true, Hooks: &control.Hooks{
			VolumeMoveStep: func(_ context.Context, _, step string) error {
				if step == control.MoveStepSwitched {
					return errors.New("killed after the switch")
				}
				return nil
			}}})
		a1 := testenv.StartAgent(t, testenv.AgentOptions{})
		a2 := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", a1.Address)
		c.RegisterHost(t, "h2", a2.Address)
		ctx := ctxT(t)
		c.Service.SyncNow(ctx)
		f := volumeFleet{c: c, agents: map[string]*testenv.Agent{"h1": a1, "h2": a2}}
		v := f.createVolume(t, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
		digest := writeMarker(t, a1, v.ID)
		if _, err := noRetry(c).MoveVolume(ctx, v.ID, "h2"); err == nil {
			t.Fatal("the move answered success although it stopped")
		}
		if err := a2.Client.DeleteVolume(ctx, v.ID); err != nil {
			t.Fatal(err)
		}
		c.Service.SyncNow(ctx)
		checkMovedTo(t, f, v, "h1", digest)
		if got := hostAllocated(t, c, "h2"); got.DiskMiB != 0 {
			t.Errorf("h2 allocates %d MiB after the move was undone, want 0", got.DiskMiB)
		}
	})
}
