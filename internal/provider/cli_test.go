package provider_test

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// The acceptance tests run against the CLI that terraform-plugin-testing
// runs: TF_ACC_TERRAFORM_PATH, else terraform on PATH; that is Terraform,
// or OpenTofu (make testacc-tofu). Each resolves a source address without a
// host (kvmfleet/kvm, or hashicorp/kvm implied by a kvm_* resource) against
// its own registry: registry.terraform.io, or registry.opentofu.org. The
// provider under test is served in process and handed to the CLI
// (TF_REATTACH_PROVIDERS) as <TF_ACC_PROVIDER_HOST>/<namespace>/kvm, which
// terraform-plugin-testing defaults to registry.terraform.io. OpenTofu does
// not map that host to its own for a reattached provider, and would look the
// provider up in its registry instead, so TestMain sets TF_ACC_PROVIDER_HOST
// to the CLI's registry unless it is set already.
//
// A TF_CLI_CONFIG_FILE that names no file is dropped (it configures nothing):
// OpenTofu prints its warning about that file on stdout, ahead of the JSON
// of `tofu version -json`, where terraform-exec reads the CLI's version, and
// every test would then fail with "unable to parse version".

// cli is the CLI the acceptance tests run; TestMain fills it when TF_ACC is set.
var cli testenv.CLI

func TestMain(m *testing.M) {
	if os.Getenv("TF_ACC") != "" {
		if rc := os.Getenv("TF_CLI_CONFIG_FILE"); rc != "" {
			if _, err := os.Stat(rc); errors.Is(err, fs.ErrNotExist) {
				fmt.Fprintf(os.Stderr, "provider acceptance tests: TF_CLI_CONFIG_FILE=%s does not exist: unset for the tests\n", rc)
				_ = os.Unsetenv("TF_CLI_CONFIG_FILE")
			}
		}
		c, err := testenv.FindCLI()
		if err == nil && os.Getenv(resource.EnvTfAccProviderHost) == "" {
			err = os.Setenv(resource.EnvTfAccProviderHost, c.RegistryHost())
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "provider acceptance tests: %v\n", err)
			os.Exit(1)
		}
		cli = c
		fmt.Fprintf(os.Stderr, "provider acceptance tests: %s v%s (%s), the provider served as %s/<namespace>/kvm\n",
			c.Product, c.Version, c.Path, os.Getenv(resource.EnvTfAccProviderHost))
	}
	os.Exit(m.Run())
}
