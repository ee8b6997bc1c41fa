package store_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// The unique index on vni is the last word on two overlays with one VNI
// (ErrVNITaken, not a duplicate name); networks without a VNI never
// collide. OverlayNICs lists the live NICs of overlay networks with their
// VM's host, and a host keeps its underlay address.
func TestOverlayVNIIndexAndNICs(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		vni := int64(4096)
		ov := store.Network{Name: "ov", Mode: store.NetworkModeOverlay, CIDR: "10.40.0.0/24", Gateway: "10.40.0.1", DHCP: true,
			RangeFirst: 0x0a280001, RangeLast: 0x0a2800fe, GatewayNum: 0x0a280001, VNI: &vni, MTU: 1450}
		if _, err := s.InsertNetwork(ctx, ov); err != nil {
			t.Fatal(err)
		}
		clash := ov
		clash.Name, clash.CIDR = "ov2", "10.41.0.0/24"
		if _, err := s.InsertNetwork(ctx, clash); !errors.Is(err, store.ErrVNITaken) {
			t.Fatalf("second network with vni 4096: %v; want ErrVNITaken", err)
		}
		addNATNetwork(t, s, "lan1")
		lan := addNATNetwork(t, s, "lan2")
		if lan.VNI != nil {
			t.Fatalf("nat network has vni %d", *lan.VNI)
		}
		if got, err := s.GetNetwork(ctx, "ov"); err != nil || got.VNI == nil || *got.VNI != 4096 || got.MTU != 1450 {
			t.Fatalf("overlay read back as %+v (%v)", got, err)
		}

		h := addHost(t, s, "h1", store.Resources{VCPUs: 4, MemoryMiB: 4, DiskMiB: 4})
		h.UnderlayAddress = "10.99.0.1"
		if _, err := s.UpsertHost(ctx, h); err != nil {
			t.Fatal(err)
		}
		if got, _ := s.GetHost(ctx, "h1"); got.UnderlayAddress != "10.99.0.1" {
			t.Fatalf("underlay address read back as %q", got.UnderlayAddress)
		}
		r := store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1}
		a := withNIC(newVM("h1", r), "ov", "02:00:00:00:00:0a", 0x0a280002)
		b := withNIC(newVM("h1", r), "lan1", "02:00:00:00:00:0b", 0x0a140002)
		for _, vm := range []store.VM{a, b} {
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatal(err)
			}
		}
		nics, err := s.OverlayNICs(ctx)
		if err != nil || len(nics) != 1 || nics[0] != (store.OverlayNIC{VMID: a.ID, Network: "ov", MACAddress: "02:00:00:00:00:0a", Address: 0x0a280002, Host: "h1"}) {
			t.Fatalf("overlay NICs %+v (%v); want a's only", nics, err)
		}
		if _, _, err := s.ReleaseVM(ctx, a.ID, "missing", "gone"); err != nil {
			t.Fatal(err)
		}
		if nics, err := s.OverlayNICs(ctx); err != nil || len(nics) != 0 {
			t.Fatalf("overlay NICs after the release %+v (%v); want none", nics, err)
		}
	})
}
