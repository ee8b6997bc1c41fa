package provider_test

import (
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

func env(vars map[string]string) provider.Option {
	return provider.WithGetenv(func(k string) string { return vars[k] })
}

func TestAccProvider_environmentFallback(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(env(map[string]string{
			provider.EnvEndpoint: f.Control.URL, provider.EnvToken: f.Control.Token,
		})),
		Steps: []resource.TestStep{
			{
				Config: `
provider "kvm" {}
data "kvm_hosts" "all" {}
`,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("data.kvm_hosts.all", tfjsonpath.New("names"),
						knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("h1")})),
				},
			},
		},
	})
}

func TestAccProvider_configErrors(t *testing.T) {
	f := newFleet(t)
	hosts := `
data "kvm_hosts" "all" {}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(env(nil)),
		Steps: []resource.TestStep{
			{
				Config:      `provider "kvm" {}` + hosts,
				ExpectError: regexp.MustCompile(`(?s)Missing KVM Control API Endpoint.*Missing KVM Control API Token`),
			},
			{
				Config:      `provider "kvm" { endpoint = "ftp://127.0.0.1:1" }` + hosts,
				ExpectError: regexp.MustCompile(`Invalid KVM Control API Endpoint`),
			},
			{
				Config: `
provider "kvm" {
  endpoint        = "http://127.0.0.1:1"
  token           = "t"
  request_timeout = "soon"
}` + hosts,
				ExpectError: regexp.MustCompile(`Invalid Duration`),
			},
			{
				// A wrong token is an error that says so, not a retry loop.
				Config: `
provider "kvm" {
  endpoint = "` + f.Control.URL + `"
  token    = "wrong"
}` + hosts,
				ExpectError: regexp.MustCompile(`rejected the token`),
			},
			{
				// Nothing listens: the error names the endpoint setting.
				Config: `
provider "kvm" {
  endpoint    = "http://127.0.0.1:1"
  token       = "t"
  max_retries = 0
}` + hosts,
				ExpectError: regexp.MustCompile(`(?s)did not answer.*endpoint`),
			},
		},
	})
}
