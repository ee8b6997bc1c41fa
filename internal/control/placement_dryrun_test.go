package control_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// placementDryRunRejections lists rejections as "host:reason", sorted.
func placementDryRunRejections(rs []api.Rejection) []string {
	out := []string{}
	for _, r := range rs {
		out = append(out, r.Host+":"+r.Reason)
	}
	slices.Sort(out)
	return out
}

// placementDryRunRequest is the dry run of a create: the same shape, host,
// constraints, NICs and volumes.
func placementDryRunRequest(in api.VMCreate) api.PlacementRequest {
	return api.PlacementRequest{Image: in.Image, VCPUs: in.VCPUs, MemoryMiB: in.MemoryMiB, DiskMiB: in.DiskMiB,
		Host: in.Host, Constraints: in.Constraints, NetworkInterfaces: in.NetworkInterfaces, Volumes: in.Volumes}
}

// TestPlacementDryRunAgreesWithCreate: POST /v1/placements answers what a
// create with the same request does: the host it lands on and the hosts it
// refuses with their reasons, or the same error (a network with no free
// address, a network the project cannot use). Each case runs the dry run,
// then the create, over real HTTP with sim agents.
func TestPlacementDryRunAgreesWithCreate(t *testing.T) {
	f := startVolumeFleet(t, "", map[string]testenv.AgentOptions{"h1": {}, "h2": {}})
	ctx := ctxT(t)
	for _, n := range []api.NetworkCreate{
		{Name: "everywhere", Mode: api.NetworkNAT, CIDR: "10.71.0.0/24"},
		{Name: "only-h1", Mode: api.NetworkNAT, CIDR: "10.71.1.0/24", Hosts: []string{"h1"}},
		{Name: "only-h2", Mode: api.NetworkNAT, CIDR: "10.71.2.0/24", Hosts: []string{"h2"}},
		{Name: "tiny", Mode: api.NetworkNAT, CIDR: "10.71.3.0/30"},
	} {
		if _, err := f.c.Client.CreateNetwork(ctx, n); err != nil {
			t.Fatalf("create network %s: %v", n.Name, err)
		}
	}
	// The one usable address of tiny is taken.
	taker := smallVM("taker")
	taker.NetworkInterfaces = []api.NetworkInterface{{Network: "tiny"}}
	if _, err := f.c.Client.CreateVM(ctx, taker, ""); err != nil {
		t.Fatalf("create the VM that takes tiny's address: %v", err)
	}
	f.createVolume(t, api.VolumeCreate{Name: "data-h2", SizeMiB: 100, Host: "h2"})
	f.createVolume(t, api.VolumeCreate{Name: "data-h1", SizeMiB: 100, Host: "h1"})

	nics := func(names ...string) []api.NetworkInterface {
		var out []api.NetworkInterface
		for _, n := range names {
			out = append(out, api.NetworkInterface{Network: n})
		}
		return out
	}
	cases := []struct {
		name    string
		nics    []api.NetworkInterface
		volumes []api.VMVolume
		host    string
	}{
		{name: "default network (no overlay, no host limit)"},
		{name: "a network on every host", nics: nics("everywhere")},
		{name: "a network on h1 only", nics: nics("only-h1")},
		{name: "a network on h2 only beside one everywhere", nics: nics("everywhere", "only-h2")},
		{name: "networks on no common host", nics: nics("only-h1", "only-h2")},
		{name: "pinned to a host the network is not on", nics: nics("only-h1"), host: "h2"},
		{name: "a network with no free address", nics: nics("tiny")},
		{name: "a network that does not exist", nics: nics("nowhere")},
		{name: "a volume on h2", volumes: []api.VMVolume{{Volume: "data-h2"}}},
		{name: "a volume on h2 and a network on h1", nics: nics("only-h1"), volumes: []api.VMVolume{{Volume: "data-h2"}}},
		{name: "volumes on two hosts", volumes: []api.VMVolume{{Volume: "data-h1"}, {Volume: "data-h2"}}},
		{name: "a volume that does not exist", volumes: []api.VMVolume{{Volume: "missing"}}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := smallVM(fmt.Sprintf("dry-%d", i))
			in.NetworkInterfaces, in.Volumes, in.Host = tc.nics, tc.volumes, tc.host
			dry, dryErr := noRetry(f.c).Place(ctx, placementDryRunRequest(in))
			vm, err := noRetry(f.c).CreateVM(ctx, in, "")
			switch {
			case dryErr != nil || (err != nil && apiCode(err) != api.CodeNoCapacity):
				var de, ce *client.Error
				if !errors.As(dryErr, &de) || !errors.As(err, &ce) || de.Status != ce.Status || de.Code != ce.Code {
					t.Fatalf("dry run answered %v, the create %v: want the same error", dryErr, err)
				}
			case err != nil:
				var ce *client.Error
				errors.As(err, &ce)
				var refused []api.Rejection
				if rs, ok := ce.Details["rejected"].([]any); ok {
					for _, r := range rs {
						m, _ := r.(map[string]any)
						h, _ := m["host"].(string)
						reason, _ := m["reason"].(string)
						refused = append(refused, api.Rejection{Host: h, Reason: reason})
					}
				}
				if len(dry.Ranked) != 0 || dry.Host != "" {
					t.Errorf("dry run ranked %v (best %q), but the create found no host: %v", dry.Ranked, dry.Host, err)
				}
				if got, want := placementDryRunRejections(dry.Rejected), placementDryRunRejections(refused); !slices.Equal(got, want) {
					t.Errorf("dry run refused %v, the create %v", got, want)
				}
			default:
				if dry.Host != vm.Host {
					t.Errorf("dry run chose host %q, the create went to %q", dry.Host, vm.Host)
				}
				var refused []api.Rejection
				if vm.Placement != nil {
					refused = vm.Placement.Rejected
				}
				if got, want := placementDryRunRejections(dry.Rejected), placementDryRunRejections(refused); !slices.Equal(got, want) {
					t.Errorf("dry run refused %v, the create %v", got, want)
				}
				if err := f.c.Client.DeleteVM(ctx, vm.ID); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
	checkLedger(t, f.c.Store)
}
