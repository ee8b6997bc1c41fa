package provider_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"
	"github.com/hashicorp/terraform-exec/tfexec"
	"github.com/hashicorp/terraform-plugin-framework/providerserver"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6/tf6server"

	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestAccModule_webTier applies examples/modules/web-tier through its module
// interface (a module block with a local source) with the terraform CLI, as
// a user's configuration would: three VMs with user data on their own nat network, from a kvm_image
// of the busybox bundle, spread one per host over three hosts. Its outputs
// give each VM a distinct address in the network's range and a distinct
// host, and the user data digests the control API holds.
func TestAccModule_webTier(t *testing.T) {
	f := newFleet(t, "h1", "h2", "h3")
	served := t.TempDir()
	sha := testenv.BundleImage(t, filepath.Join(testenv.GuestImageDir(t), "busybox"), filepath.Join(served, "busybox.tar"))
	srv := testenv.StartImageServer(t, served)
	source, err := filepath.Abs("../../examples/modules/web-tier")
	if err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`
terraform {
  required_providers {
    kvm = {
      source = "kvmfleet/kvm"
    }
  }
}

provider "kvm" {
  endpoint = %q
  token    = %q
}

module "web" {
  source = %q

  name     = "shop"
  vm_count = 3
  image    = "shop-busybox"
  image_source = {
    source_url = %q
    sha256     = %q
  }
  cidr           = "10.91.0.0/24"
  max_per_domain = 1
}

output "addresses" {
  value = module.web.addresses
}

output "hosts" {
  value = module.web.hosts
}

output "vm_ids" {
  value = module.web.vm_ids
}

output "user_data_sha256" {
  value = module.web.user_data_sha256
}
`, f.Control.URL, f.Control.Token, source, srv.FileURL("busybox.tar"), sha)

	prefix := netip.MustParsePrefix("10.91.0.0/24")
	tf := newTerraformCLI(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	t.Cleanup(func() {
		// Destroy whatever an apply made, then check that nothing is left.
		if err := tf.Destroy(context.Background(), tf.reattach()); err != nil {
			t.Errorf("terraform destroy: %v", err)
		}
		if err := f.checkFleetEmpty(nil); err != nil {
			t.Error(err)
		}
	})
	if err := tf.Apply(ctx, tf.reattach()); err != nil {
		t.Fatalf("terraform apply of the module: %v", err)
	}
	if changes, err := tf.Plan(ctx, tf.reattach()); err != nil || changes {
		t.Fatalf("terraform plan after apply: changes %v, %v; want none", changes, err)
	}
	outs, err := tf.Output(ctx)
	if err != nil {
		t.Fatalf("terraform output: %v", err)
	}
	var addrs, hosts, ids, digests map[string]string
	for name, dst := range map[string]*map[string]string{"addresses": &addrs, "hosts": &hosts, "vm_ids": &ids, "user_data_sha256": &digests} {
		if err := json.Unmarshal(outs[name].Value, dst); err != nil {
			t.Fatalf("output %s = %s: %v", name, outs[name].Value, err)
		}
	}
	if len(addrs) != 3 || len(hosts) != 3 || len(ids) != 3 || len(digests) != 3 {
		t.Fatalf("outputs: addresses %v, hosts %v, ids %v, digests %v: want 3 VMs each", addrs, hosts, ids, digests)
	}
	seenAddr, seenHost := map[string]bool{}, map[string]bool{}
	for i := range 3 {
		name := fmt.Sprintf("shop-web-%d", i)
		addr := addrs[name]
		ip, err := netip.ParseAddr(addr)
		if err != nil || !prefix.Contains(ip) || seenAddr[addr] {
			t.Errorf("%s: address %q is not a distinct address in %s (%v)", name, addr, prefix, err)
		}
		host := hosts[name]
		if host == "" || seenHost[host] {
			t.Errorf("%s: host %q: max_per_domain = 1 over three hosts wants one VM per host (%v)", name, host, hosts)
		}
		seenAddr[addr], seenHost[host] = true, true
		vm, err := f.Control.Client.GetVM(ctx, ids[name])
		if err != nil {
			t.Fatal(err)
		}
		want := sha256Hex(fmt.Sprintf("#cloud-config\nwrite_files:\n  - path: /etc/web-tier\n    content: \"%s %d\\n\"\n", name, i))
		if digests[name] != want || vm.UserDataSHA256 != want || vm.IPv4Address != addr || vm.Image != "shop-busybox" ||
			vm.Hostname != name || vm.Host != host {
			t.Errorf("%s: output digest %s, control API %+v; want digest %s of the rendered default user data",
				name, digests[name], vm, want)
		}
	}
}

// terraformCLI runs the real CLI (terraform or tofu: see cli_test.go) in a
// directory of the test's on one configuration, with this provider served in process (reattach), as
// terraform-plugin-testing does. It exists for configurations that call
// modules, which terraform-plugin-testing does not support (its state shim
// refuses child modules, and its init never installs them).
type terraformCLI struct {
	*tfexec.Terraform
	info tfexec.ReattachInfo
}

func (c *terraformCLI) reattach() *tfexec.ReattachOption { return tfexec.Reattach(c.info) }

func newTerraformCLI(t *testing.T, cfg string) *terraformCLI {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.tf"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	if cli.Path == "" {
		t.Skip("acceptance test: set TF_ACC=1 (make testacc) to run it with the terraform CLI")
	}
	tf, err := tfexec.NewTerraform(dir, cli.Path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	reattachCh := make(chan *plugin.ReattachConfig, 1)
	closed := make(chan struct{})
	serveErr := make(chan error, 1)
	// The address the CLI resolves kvmfleet/kvm to (see cli_test.go).
	addr := cli.ProviderAddress()
	go func() {
		serveErr <- tf6server.Serve(addr,
			providerserver.NewProtocol6(provider.New("test")()),
			tf6server.WithDebug(ctx, reattachCh, closed), tf6server.WithoutLogStderrOverride(),
			tf6server.WithGoPluginLogger(hclog.NewNullLogger()))
	}()
	var rc *plugin.ReattachConfig
	select {
	case rc = <-reattachCh:
	case err := <-serveErr:
		cancel()
		t.Fatalf("serving the provider: %v", err)
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("the provider did not start serving within 30 s")
	}
	t.Cleanup(func() {
		cancel()
		<-closed
	})
	c := &terraformCLI{Terraform: tf, info: tfexec.ReattachInfo{addr: tfexec.ReattachConfig{
		Protocol: string(rc.Protocol), ProtocolVersion: rc.ProtocolVersion, Pid: rc.Pid, Test: true,
		Addr: tfexec.ReattachConfigAddr{Network: rc.Addr.Network(), String: rc.Addr.String()},
	}}}
	initCtx, initCancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer initCancel()
	if err := tf.Init(initCtx, c.reattach()); err != nil {
		t.Fatalf("terraform init (installs the module): %v", err)
	}
	return c
}
