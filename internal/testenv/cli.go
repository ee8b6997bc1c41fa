package testenv

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"time"
)

// CLI is the Terraform or OpenTofu binary the tests that run a real CLI
// use: TF_ACC_TERRAFORM_PATH (as terraform-plugin-testing reads it), else
// terraform on PATH.
type CLI struct {
	Path    string // the binary
	Product string // "Terraform" or "OpenTofu", as its `version` says
	Version string // e.g. 1.11.4
}

// RegistryHost is the host a provider source address without one
// (kvmfleet/kvm) resolves to: each CLI's own default registry.
func (c CLI) RegistryHost() string {
	if c.Product == "OpenTofu" {
		return "registry.opentofu.org"
	}
	return "registry.terraform.io"
}

// ProviderAddress is this provider's full source address for the CLI.
func (c CLI) ProviderAddress() string { return c.RegistryHost() + "/kvmfleet/kvm" }

// FindCLI finds the CLI (TF_ACC_TERRAFORM_PATH, else terraform on PATH)
// and asks it what it is, with no update check.
func FindCLI() (CLI, error) {
	path := os.Getenv("TF_ACC_TERRAFORM_PATH")
	if path == "" {
		p, err := exec.LookPath("terraform")
		if err != nil {
			return CLI{}, fmt.Errorf("no terraform on PATH and TF_ACC_TERRAFORM_PATH is not set: install terraform, " +
				"or point TF_ACC_TERRAFORM_PATH at a terraform or tofu binary (make tofu builds tofu)")
		}
		path = p
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, "version")
	cmd.Env = append(os.Environ(), "CHECKPOINT_DISABLE=1")
	out, err := cmd.Output()
	if err != nil {
		return CLI{}, fmt.Errorf("%s version: %w (TF_ACC_TERRAFORM_PATH must name a terraform or tofu binary)", path, err)
	}
	return ParseCLIVersion(path, out)
}

var cliVersionLine = regexp.MustCompile(`(?m)^(Terraform|OpenTofu) v(\S+)`)

// ParseCLIVersion reads the output of `<path> version`.
func ParseCLIVersion(path string, out []byte) (CLI, error) {
	m := cliVersionLine.FindSubmatch(out)
	if m == nil {
		first, _, _ := bytes.Cut(out, []byte("\n"))
		return CLI{}, fmt.Errorf("%s version printed %q, which names neither Terraform nor OpenTofu", path, first)
	}
	return CLI{Path: path, Product: string(m[1]), Version: string(m[2])}, nil
}
