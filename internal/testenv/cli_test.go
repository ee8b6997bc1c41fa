package testenv

import "testing"

func TestParseCLIVersion(t *testing.T) {
	for _, tc := range []struct {
		out, product, version, address string
	}{
		{"Terraform v1.11.4\non linux_amd64\n", "Terraform", "1.11.4", "registry.terraform.io/kvmfleet/kvm"},
		{"OpenTofu v1.12.6\non linux_amd64\n", "OpenTofu", "1.12.6", "registry.opentofu.org/kvmfleet/kvm"},
		{"a warning first\nOpenTofu v1.12.6\n", "OpenTofu", "1.12.6", "registry.opentofu.org/kvmfleet/kvm"},
	} {
		c, err := ParseCLIVersion("/bin/x", []byte(tc.out))
		if err != nil || c.Product != tc.product || c.Version != tc.version || c.ProviderAddress() != tc.address {
			t.Errorf("ParseCLIVersion(%q) = %+v (address %s), %v; want %s %s (address %s)",
				tc.out, c, c.ProviderAddress(), err, tc.product, tc.version, tc.address)
		}
	}
	if _, err := ParseCLIVersion("/bin/x", []byte("something else v1\n")); err == nil {
		t.Error("ParseCLIVersion accepted a version line that names neither Terraform nor OpenTofu")
	}
}
