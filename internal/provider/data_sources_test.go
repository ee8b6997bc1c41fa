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

func TestAccDataSources(t *testing.T) {
	f := newFleet(t, "alpha", "beta")
	ctx := context.Background()
	// Label one host, and fill beta so that the scheduler prefers alpha.
	schedulable := true
	if _, err := f.Control.Client.PutHost(ctx, "beta", api.HostPut{
		Address: f.Agents["beta"].Address, Labels: map[string]string{"rack": "r2"}, Schedulable: &schedulable,
	}); err != nil {
		t.Fatalf("labelling host beta: %v", err)
	}

	cfg := f.providerBlock() + `
resource "kvm_vm" "test" {
  name       = "ds-vm"
  image      = "sim"
  vcpus      = 4
  memory_mib = 8192
  disk_mib   = 1024
  host       = "beta"
}

data "kvm_host" "beta" {
  name       = "beta"
  depends_on = [kvm_vm.test]
}

data "kvm_hosts" "all" {
  depends_on = [kvm_vm.test]
}

data "kvm_hosts" "rack2" {
  labels = { rack = "r2" }
}

data "kvm_vm" "by_name" {
  name = kvm_vm.test.name
}

data "kvm_vm" "by_id" {
  id = kvm_vm.test.id
}

data "kvm_placement" "small" {
  image      = "sim"
  vcpus      = 1
  memory_mib = 1024
  disk_mib   = 1024
  depends_on = [kvm_vm.test]
}

data "kvm_placement" "huge" {
  image      = "sim"
  vcpus      = 1
  memory_mib = 1048576
  disk_mib   = 1024
}

data "kvm_placement" "no_image" {
  image      = "windows"
  vcpus      = 1
  memory_mib = 64
  disk_mib   = 64
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: cfg,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("data.kvm_host.beta", tfjsonpath.New("alive"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue("data.kvm_host.beta", tfjsonpath.New("last_seen"), knownvalue.NotNull()),
					statecheck.ExpectKnownValue("data.kvm_host.beta", tfjsonpath.New("allocated"), resourcesValue(api.Resources{
						VCPUs: 4, MemoryMiB: 8192, DiskMiB: 1024,
					})),
					statecheck.ExpectKnownValue("data.kvm_host.beta", tfjsonpath.New("free").AtMapKey("memory_mib"),
						knownvalue.Int64Exact(testHostMemoryMiB-8192)),

					statecheck.ExpectKnownValue("data.kvm_hosts.all", tfjsonpath.New("names"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.StringExact("alpha"), knownvalue.StringExact("beta"),
					})),
					statecheck.ExpectKnownValue("data.kvm_hosts.all", tfjsonpath.New("hosts").AtSliceIndex(1).AtMapKey("allocated").AtMapKey("vcpus"),
						knownvalue.Int64Exact(4)),
					statecheck.ExpectKnownValue("data.kvm_hosts.rack2", tfjsonpath.New("names"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.StringExact("beta"),
					})),

					statecheck.ExpectKnownValue("data.kvm_vm.by_name", tfjsonpath.New("host"), knownvalue.StringExact("beta")),
					statecheck.ExpectKnownValue("data.kvm_vm.by_name", tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
					statecheck.ExpectKnownValue("data.kvm_vm.by_id", tfjsonpath.New("name"), knownvalue.StringExact("ds-vm")),
					statecheck.ExpectKnownValue("data.kvm_vm.by_id", tfjsonpath.New("memory_mib"), knownvalue.Int64Exact(8192)),

					statecheck.ExpectKnownValue("data.kvm_placement.small", tfjsonpath.New("fits"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue("data.kvm_placement.small", tfjsonpath.New("chosen_host"), knownvalue.StringExact("alpha")),
					statecheck.ExpectKnownValue("data.kvm_placement.small", tfjsonpath.New("score"), knownvalue.NotNull()),
					statecheck.ExpectKnownValue("data.kvm_placement.small", tfjsonpath.New("ranked"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectPartial(map[string]knownvalue.Check{"host": knownvalue.StringExact("alpha")}),
						knownvalue.ObjectPartial(map[string]knownvalue.Check{"host": knownvalue.StringExact("beta")}),
					})),
					statecheck.ExpectKnownValue("data.kvm_placement.small", tfjsonpath.New("rejected"), knownvalue.ListSizeExact(0)),

					statecheck.ExpectKnownValue("data.kvm_placement.huge", tfjsonpath.New("fits"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue("data.kvm_placement.huge", tfjsonpath.New("chosen_host"), knownvalue.Null()),
					statecheck.ExpectKnownValue("data.kvm_placement.huge", tfjsonpath.New("ranked"), knownvalue.ListSizeExact(0)),
					statecheck.ExpectKnownValue("data.kvm_placement.huge", tfjsonpath.New("rejected"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"host": knownvalue.StringExact("alpha"), "reason": knownvalue.StringExact("memory"),
							"detail": knownvalue.StringRegexp(regexp.MustCompile(`^memory: needs 1048576 MiB, \d+ free$`)),
						}),
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"host": knownvalue.StringExact("beta"), "reason": knownvalue.StringExact("memory"),
							"detail": knownvalue.StringRegexp(regexp.MustCompile(`^memory: needs 1048576 MiB, \d+ free$`)),
						}),
					})),
					statecheck.ExpectKnownValue("data.kvm_placement.no_image", tfjsonpath.New("rejected").AtSliceIndex(0).AtMapKey("reason"),
						knownvalue.StringExact("no_image")),
				},
			},
		},
	})
}

func TestAccVMDataSource_notFound(t *testing.T) {
	f := newFleet(t)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{
			{
				Config:      f.providerBlock() + `data "kvm_vm" "x" { name = "nobody" }`,
				ExpectError: regexp.MustCompile(`No such VM`),
			},
			{
				Config:      f.providerBlock() + `data "kvm_vm" "x" {}`,
				ExpectError: regexp.MustCompile(`Missing Attribute Configuration`),
			},
			{
				Config: f.providerBlock() + `data "kvm_vm" "x" {
  id   = "a"
  name = "b"
}`,
				ExpectError: regexp.MustCompile(`Invalid Attribute Combination`),
			},
		},
	})
}
