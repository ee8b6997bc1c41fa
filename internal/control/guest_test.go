package control_test

import (
	"context"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A create with guest configuration boots cold even with a matching warm
// VM ready: the warm VM booted before its seed could exist. started_from
// and the placement note say so; the warm VM stays for a create without.
// The configuration is kept in the database (the VM's row and its fork's,
// so that a child gets it) on both databases.
func TestGuestConfigBootsColdPastTheWarmPool(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL})
		ag := startSimAgent(t)
		ctx := context.Background()
		if _, err := c.Client.PutHost(ctx, "h1", api.HostPut{Address: ag.Address, WarmPool: warmTarget(1)}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "GET /v1/hosts/h1 shows 1 ready warm VM", func() bool { return hostReady(t, c, "h1") == 1 })
		in := warmVM("configured")
		in.UserData = "#cloud-config\n{}\n"
		in.MetaData = map[string]string{"local-hostname": "cfg.example.test", "zone": "a"}
		vm, err := c.Client.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		if vm.StartedFrom != api.StartedCold || vm.Placement == nil ||
			!strings.Contains(vm.Placement.Note, "cold: guest configuration needs its own seed at first boot") {
			t.Fatalf("create with user data: started_from %q, placement %+v; want cold with the note", vm.StartedFrom, vm.Placement)
		}
		if n := hostReady(t, c, "h1"); n != 1 {
			t.Errorf("the warm VM was used or lost: %d ready", n)
		}
		row, err := c.Store.GetVM(ctx, vm.ID)
		if err != nil || row.Guest == nil || row.Guest.UserData != in.UserData || row.Guest.Hostname != "cfg.example.test" ||
			row.Guest.MetaData["zone"] != "a" {
			t.Fatalf("stored guest configuration: %+v %v", row.Guest, err)
		}
		f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: vm.ID, Count: 2}, "")
		if err != nil || len(f.Children) != 2 {
			t.Fatalf("fork: %+v %v", f, err)
		}
		for _, ch := range f.Children {
			r, err := c.Store.GetVM(ctx, ch.ID)
			if err != nil || r.Guest == nil || r.Guest.UserData != in.UserData || r.Guest.Hostname != strings.ToLower(ch.Name) ||
				r.Guest.MetaData["zone"] != "a" || r.Guest.MetaData["local-hostname"] != "" {
				t.Errorf("child %s: stored guest %+v %v", ch.Name, r.Guest, err)
			}
			if ch.Hostname == f.Children[0].Hostname && ch.ID != f.Children[0].ID {
				t.Errorf("two children share hostname %s", ch.Hostname)
			}
		}
		warm, err := c.Client.CreateVM(ctx, warmVM("plain"), "")
		if err != nil {
			t.Fatal(err)
		}
		if warm.StartedFrom != api.StartedWarm || (warm.Placement != nil && strings.Contains(warm.Placement.Note, "guest configuration")) {
			t.Errorf("create without guest configuration: %q %+v, want warm", warm.StartedFrom, warm.Placement)
		}
		if row, err := c.Store.GetVM(ctx, warm.ID); err != nil || row.Guest != nil {
			t.Errorf("plain VM's stored guest: %+v %v", row.Guest, err)
		}
	})
}
