package provider_test

import (
	"context"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// TestAccPlacement_networksAndVolumes: kvm_placement with networks and
// volumes refuses the hosts a create would refuse, with the same reasons,
// and fails as a create would on a network with no free address.
func TestAccPlacement_networksAndVolumes(t *testing.T) {
	f := newFleet(t, "h1", "h2")
	ctx := context.Background()
	for _, n := range []api.NetworkCreate{
		{Name: "only-h1", Mode: api.NetworkNAT, CIDR: "10.73.1.0/24", Hosts: []string{"h1"}},
		{Name: "tiny", Mode: api.NetworkNAT, CIDR: "10.73.3.0/30"},
	} {
		if _, err := f.Control.Client.CreateNetwork(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	taker := api.VMCreate{Name: "taker", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 256,
		NetworkInterfaces: []api.NetworkInterface{{Network: "tiny"}}}
	if _, err := f.Control.Client.CreateVM(ctx, taker, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Control.Client.CreateVolume(ctx, api.VolumeCreate{Name: "data", SizeMiB: 100, Host: "h2"}); err != nil {
		t.Fatal(err)
	}
	rejection := func(host, reason string) knownvalue.Check {
		return knownvalue.ObjectPartial(map[string]knownvalue.Check{"host": knownvalue.StringExact(host), "reason": knownvalue.StringExact(reason)})
	}
	const shape = `
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{
			{
				Config: f.providerBlock() + `
data "kvm_placement" "net" {` + shape + `  networks = ["only-h1"]
}
data "kvm_placement" "both" {` + shape + `  networks = ["only-h1"]
  volumes  = ["data"]
}
`,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("data.kvm_placement.net", tfjsonpath.New("chosen_host"), knownvalue.StringExact("h1")),
					statecheck.ExpectKnownValue("data.kvm_placement.net", tfjsonpath.New("rejected"),
						knownvalue.ListExact([]knownvalue.Check{rejection("h2", api.ReasonNetwork)})),
					statecheck.ExpectKnownValue("data.kvm_placement.both", tfjsonpath.New("fits"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue("data.kvm_placement.both", tfjsonpath.New("rejected"),
						knownvalue.ListExact([]knownvalue.Check{rejection("h1", api.ReasonVolume), rejection("h2", api.ReasonNetwork)})),
				},
			},
			{
				Config: f.providerBlock() + `
data "kvm_placement" "tiny" {` + shape + `  networks = ["tiny"]
}
`,
				ExpectError: regexp.MustCompile(`(?s)network "tiny" has no free address`),
			},
		},
	})
}
