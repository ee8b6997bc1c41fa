package faulttest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// movedVolumesLedger checks that every volume is ready, that each host's disk
// allocation equals the sizes of the volumes on it (the test has no VMs),
// and that each agent has exactly the volumes whose rows name its host.
func movedVolumesLedger(ctx context.Context, c *client.Client, agents map[string]*agentapi.Client) error {
	hosts, err := c.AllHosts(ctx)
	if err != nil {
		return err
	}
	list, err := c.ListVolumes(ctx, 0, "")
	if err != nil {
		return err
	}
	sum := map[string]int64{}
	rows := map[string][]string{}
	var problems []string
	for _, v := range list.Items {
		if v.State != api.VolumeReady {
			problems = append(problems, fmt.Sprintf("volume %s is %s on %s (%s)", v.ID, v.State, v.Host, v.Reason))
		}
		sum[v.Host] += v.SizeMiB
		rows[v.Host] = append(rows[v.Host], v.ID)
	}
	for _, h := range hosts {
		if h.Allocated.DiskMiB != sum[h.Name] || h.Allocated.VCPUs != 0 {
			problems = append(problems, fmt.Sprintf("host %s allocates %+v, its volumes add up to %d MiB of disk", h.Name, h.Allocated, sum[h.Name]))
		}
		a, ok := agents[h.Name]
		if !ok {
			continue
		}
		vols, err := a.ListVolumes(ctx)
		if err != nil {
			return fmt.Errorf("list volumes of the agent of %s: %w", h.Name, err)
		}
		var got []string
		for _, v := range vols {
			got = append(got, v.ID)
		}
		want := rows[h.Name]
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			problems = append(problems, fmt.Sprintf("host %s: agent has volumes %v, rows name %v", h.Name, got, want))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// kvmd control is killed with SIGKILL at each step of a volume move: while
// the source's agent exports it (the digest read), while the target's
// agent is asked to pull it, after the target pulled it (its answer held),
// and after the switch while the source's agent is asked to delete its
// copy. After a restart the host monitor undoes the first two and finishes
// the others: the volume is ready on one host, each host allocates what
// its volumes hold, and each agent has exactly the volumes of its rows.
// Moves work again afterwards.
func TestKill9DuringVolumeMove(t *testing.T) {
	bin := buildKVMD(t)
	type gateAt struct {
		name     string
		onSource bool
		forward  bool
		method   string
		suffix   string
		finished bool
	}
	for _, tc := range []gateAt{
		{name: "digest", onSource: true, method: http.MethodGet, suffix: "/content"},
		{name: "pull", method: http.MethodPut},
		{name: "pulled", forward: true, method: http.MethodPut, finished: true},
		{name: "source delete", onSource: true, method: http.MethodDelete, finished: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(t *testing.T, databaseURL, dataDir string) {
				ctx := ctxT(t, 3*time.Minute)
				k := startKVMD(t, bin, databaseURL, dataDir)
				a1 := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
				a2 := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 100000})
				gated := a2
				if tc.onSource {
					gated = a1
				}
				var moving atomic.Pointer[string] // the id of the volume that moves, once known
				gate := startCallGate(t, gated.URL, tc.forward, func(r *http.Request) bool {
					id := moving.Load()
					return id != nil && r.Method == tc.method && r.URL.Path == "/v1/volumes/"+*id+tc.suffix
				})
				gated.AllowAddress(t, gate.address)
				addr := map[string]string{"h1": a1.Address, "h2": a2.Address}
				if tc.onSource {
					addr["h1"] = gate.address
				} else {
					addr["h2"] = gate.address
				}
				for _, h := range []string{"h1", "h2"} {
					if _, err := k.client(true).PutHost(ctx, h, api.HostPut{Address: addr[h]}); err != nil {
						t.Fatal(err)
					}
				}
				agents := map[string]*agentapi.Client{"h1": a1.Client, "h2": a2.Client}
				var v api.Volume
				eventually(t, "the hosts are synced and take a volume", func() error {
					var err error
					v, err = k.client(false).CreateVolume(ctx, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
					return err
				})
				if _, err := k.client(true).CreateVolume(ctx, api.VolumeCreate{Name: "other", SizeMiB: 8, Host: "h2"}); err != nil {
					t.Fatal(err)
				}
				moving.Store(&v.ID)
				answered := make(chan error, 1)
				go func() {
					_, err := k.client(false).MoveVolume(ctx, v.ID, "h2")
					answered <- err
				}()
				select {
				case <-gate.reached:
				case err := <-answered:
					t.Fatalf("the move answered (%v) before the gate held its %s call", err, tc.name)
				case <-ctx.Done():
					t.Fatalf("the move never reached the gate at %s", tc.name)
				}
				if got, err := k.client(true).GetVolume(ctx, v.ID); err != nil || got.State != api.VolumeMoving {
					t.Errorf("while the move is held at %s, GET shows %+v (%v); want moving", tc.name, got, err)
				}
				k.kill()
				if err := <-answered; err == nil {
					t.Fatal("the move answered success although kvmd was killed before it finished")
				}

				k2 := startKVMD(t, bin, databaseURL, dataDir)
				c2 := k2.client(true)
				want := "h1"
				if tc.finished {
					want = "h2"
				}
				eventually(t, "the restarted control plane settles the move", func() error {
					if err := movedVolumesLedger(ctx, c2, agents); err != nil {
						return err
					}
					got, err := c2.GetVolume(ctx, v.ID)
					if err != nil {
						return err
					}
					if got.Host != want {
						return fmt.Errorf("volume %s settled on %s, want %s", v.ID, got.Host, want)
					}
					return nil
				})
				// Moves work again: back and forth.
				other := map[string]string{"h1": "h2", "h2": "h1"}[want]
				if got, err := c2.MoveVolume(ctx, v.ID, other); err != nil || got.Host != other {
					t.Fatalf("move after the restart: %+v, %v", got, err)
				}
				if err := movedVolumesLedger(ctx, c2, agents); err != nil {
					t.Error(err)
				}
			}
			t.Run("sqlite", func(t *testing.T) { run(t, "", t.TempDir()) })
			t.Run("postgres", func(t *testing.T) { run(t, testenv.PostgresURL(t), "") })
		})
	}
}

// freeAddress is a free 127.0.0.1 port.
func freeAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// kvmd agent is killed with SIGKILL during a volume move, the target's or
// the source's, at the step where it works: the target while it pulls the
// volume, the target after it pulled it (before the control plane heard),
// the source while it sends the volume, the source after the switch while
// it is asked to delete its copy. The move fails or leaves its end to the
// host monitor; once the agent is back, the volume is ready on one host
// (the target when it had the complete copy), each host allocates what
// its volumes hold and each agent has exactly the volumes of its rows.
func TestKill9AgentDuringVolumeMove(t *testing.T) {
	bin := buildKVMD(t)
	for _, tc := range []struct {
		name       string
		killSource bool // kill h1's agent, else h2's
		gateSource bool // the gate is in front of h1's agent, else h2's
		forward    bool
		method     string
		suffix     string
		nth        int32 // which matching call is held (1: the first)
		finished   bool
	}{
		// The target's pull is the second content read (the first is the digest's).
		{name: "target while it pulls", gateSource: true, method: http.MethodGet, suffix: "/content", nth: 2},
		{name: "target after it pulled", forward: true, method: http.MethodPut, nth: 1, finished: true},
		{name: "source while it sends", killSource: true, gateSource: true, method: http.MethodGet, suffix: "/content", nth: 2},
		{name: "source at its delete", killSource: true, gateSource: true, method: http.MethodDelete, nth: 1, finished: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t, 3*time.Minute)
			k := startKVMD(t, bin, "", t.TempDir())
			addr := map[string]string{"h1": freeAddress(t), "h2": freeAddress(t)}
			gated := "h2"
			if tc.gateSource {
				gated = "h1"
			}
			var seen atomic.Int32
			var moving atomic.Pointer[string] // the id of the volume that moves, once known
			gate := startCallGate(t, "http://"+addr[gated], tc.forward, func(r *http.Request) bool {
				id := moving.Load()
				return id != nil && r.Method == tc.method && r.URL.Path == "/v1/volumes/"+*id+tc.suffix && seen.Add(1) == tc.nth
			})
			agents := map[string]*kvmdAgent{}
			for _, h := range []string{"h1", "h2"} {
				advertise := ""
				if h == gated {
					advertise = gate.address
				}
				agents[h] = startKVMDAgentAt(t, bin, addr[h], advertise)
				registered := "http://" + addr[h]
				if h == gated {
					registered = gate.address
				}
				if _, err := k.client(true).PutHost(ctx, h, api.HostPut{Address: registered}); err != nil {
					t.Fatal(err)
				}
			}
			clients := map[string]*agentapi.Client{"h1": agents["h1"].client, "h2": agents["h2"].client}
			var v api.Volume
			eventually(t, "the hosts are synced and take a volume", func() error {
				var err error
				v, err = k.client(false).CreateVolume(ctx, api.VolumeCreate{Name: "data", SizeMiB: 8, Host: "h1"})
				return err
			})
			moving.Store(&v.ID)
			answered := make(chan error, 1)
			go func() {
				_, err := k.client(false).MoveVolume(ctx, v.ID, "h2")
				answered <- err
			}()
			select {
			case <-gate.reached:
			case err := <-answered:
				t.Fatalf("the move answered (%v) before the gate held its call", err)
			case <-ctx.Done():
				t.Fatal("the move never reached the gate")
			}
			victim := agents["h2"]
			if tc.killSource {
				victim = agents["h1"]
			}
			victim.kill()
			close(gate.abort)
			err := <-answered
			t.Logf("the move answered: %v", err)
			if !tc.finished && err == nil {
				t.Fatal("the move answered success although an agent died before the copy was made")
			}
			victim.start(t)
			want := "h1"
			if tc.finished {
				want = "h2"
			}
			c := k.client(true)
			eventually(t, "the host monitor settles the move", func() error {
				if err := movedVolumesLedger(ctx, c, clients); err != nil {
					return err
				}
				got, err := c.GetVolume(ctx, v.ID)
				if err != nil {
					return err
				}
				if got.Host != want {
					return fmt.Errorf("volume %s settled on %s, want %s", v.ID, got.Host, want)
				}
				return nil
			})
			for _, h := range []string{"h1", "h2"} {
				dir := filepath.Join(agents[h].stateDir, "volumes", v.ID)
				if _, err := os.Stat(dir); (h == want) != (err == nil) {
					t.Errorf("host %s: directory of volume %s: %v (the volume is on %s)", h, v.ID, err, want)
				}
			}
		})
	}
}
