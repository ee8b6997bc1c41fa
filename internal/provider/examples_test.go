package provider_test

import (
	"os"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

// TestAccExamples_quickstart applies examples/quickstart as `make demo` does
// (endpoint and token from the environment, the sim image), and checks that
// a plan right after the apply is empty, outputs included.
func TestAccExamples_quickstart(t *testing.T) {
	f := newFleet(t, "local")
	main, err := os.ReadFile("../../examples/quickstart/main.tf")
	if err != nil {
		t.Fatalf("reading the quickstart: %v", err)
	}
	_, key := newSSHKey(t)
	// The quickstart names its real source address, kvmfleet/kvm.
	t.Setenv(resource.EnvTfAccProviderNamespace, "kvmfleet")

	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(env(map[string]string{
			provider.EnvEndpoint: f.Control.URL, provider.EnvToken: f.Control.Token,
		})),
		CheckDestroy: f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: string(main),
				ConfigVariables: config.Variables{"image": config.StringVariable("sim"), "guest_image": config.StringVariable("sim"),
					"ssh_public_key": config.StringVariable(key)},
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownOutputValue("vms", knownvalue.MapExact(map[string]knownvalue.Check{
						"demo-0": knownvalue.ObjectPartial(map[string]knownvalue.Check{
							"host": knownvalue.StringExact("local"), "observed_state": knownvalue.StringExact("running"),
						}),
						"demo-1": knownvalue.ObjectPartial(map[string]knownvalue.Check{
							"host": knownvalue.StringExact("local"), "observed_state": knownvalue.StringExact("running"),
						}),
					})),
					statecheck.ExpectKnownOutputValueAtPath("hosts", tfjsonpath.New("local").AtMapKey("free").AtMapKey("vcpus"),
						knownvalue.Int64Exact(testHostVCPUs-3)),
					statecheck.ExpectKnownOutputValue("guest", knownvalue.ObjectPartial(map[string]knownvalue.Check{
						"hostname":         knownvalue.StringExact("demo-guest"),
						"started_from":     knownvalue.StringExact("cold"),
						"user_data_sha256": knownvalue.StringRegexp(regexp.MustCompile(`^[0-9a-f]{64}$`)),
						"ssh":              knownvalue.StringRegexp(regexp.MustCompile(`^ssh -p [0-9]+ debian@127\.0\.0\.1$`)),
					})),
					statecheck.ExpectKnownOutputValueAtPath("placement", tfjsonpath.New("host"), knownvalue.StringExact("local")),
					statecheck.ExpectKnownOutputValueAtPath("placement", tfjsonpath.New("fits"), knownvalue.Bool(true)),
					statecheck.ExpectKnownOutputValueAtPath("vms", tfjsonpath.New("demo-0").AtMapKey("placement"),
						knownvalue.StringRegexp(regexp.MustCompile(`^placed on local`))),
				},
			},
		},
	})
}
