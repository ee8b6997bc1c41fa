package control_test

import (
	"net/http"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestForkChildGuestAddressAlias: a child on a nat network is reached at an
// address of its own, while its guest keeps its source's address inside,
// where it names the child itself (the source is not reachable there from
// the child; docs/guides/networks.md). The fork's answer says so: each such
// NIC shows guest_ipv4_address, the source's address, beside the child's
// own ipv4_address. A user-mode NIC has no such alias.
func TestForkChildGuestAddressAlias(t *testing.T) {
	f := startVolumeFleet(t, "", map[string]testenv.AgentOptions{"h1": {}})
	ctx := ctxT(t)
	if _, err := f.c.Client.CreateNetwork(ctx, api.NetworkCreate{Name: "lab", Mode: api.NetworkNAT, CIDR: "10.72.0.0/24"}); err != nil {
		t.Fatal(err)
	}
	in := smallVM("source")
	in.NetworkInterfaces = []api.NetworkInterface{{Network: "lab"}, {Network: api.DefaultNetwork}}
	src, err := f.c.Client.CreateVM(ctx, in, "")
	if err != nil {
		t.Fatal(err)
	}
	fork, err := f.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2}, "")
	if err != nil {
		t.Fatal(err)
	}
	// Raw JSON: the field must be on the wire.
	var raw struct {
		Children []struct {
			Name              string           `json:"name"`
			NetworkInterfaces []map[string]any `json:"network_interfaces"`
		} `json:"children"`
	}
	if status, e := f.call(t, http.MethodGet, "/v1/forks/"+fork.ID, nil, &raw); status != http.StatusOK {
		t.Fatalf("GET fork: %d %+v", status, e)
	}
	if len(raw.Children) != 2 {
		t.Fatalf("fork has %d children, want 2", len(raw.Children))
	}
	srcAddr := src.NetworkInterfaces[0].IPv4Address
	for _, c := range raw.Children {
		if len(c.NetworkInterfaces) != 2 {
			t.Fatalf("child %s has %d NICs, want 2", c.Name, len(c.NetworkInterfaces))
		}
		nat, user := c.NetworkInterfaces[0], c.NetworkInterfaces[1]
		if nat["guest_ipv4_address"] != srcAddr || nat["ipv4_address"] == srcAddr || nat["ipv4_address"] == nil {
			t.Errorf("child %s nat NIC = %v; want guest_ipv4_address %s (the source's) beside an address of its own",
				c.Name, nat, srcAddr)
		}
		if _, ok := user["guest_ipv4_address"]; ok {
			t.Errorf("child %s user-mode NIC = %v; want no guest_ipv4_address", c.Name, user)
		}
	}
}
