package provider_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// TestAccNetwork_realGuestsEndToEnd runs the whole product on real guests:
// the terraform CLI makes a nat network and two VMs on it, plus a VM with a
// user-mode port forward, on a real QEMU agent (TCG). The addresses in
// Terraform's state come from the control plane's IPAM; each guest prints
// the address it got by DHCP, which must be the same; each guest reaches the
// other but not the host on the gateway address; and 127.0.0.1 on the reported host port reaches the
// third guest. Everything runs in a network namespace the test makes, so no
// traffic reaches the machine's own network.
func TestAccNetwork_realGuestsEndToEnd(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 4, MemoryMiB: 2048, DiskMiB: 4096})
	f.Control.RegisterHost(t, "q1", a.Address)
	f.Agents["q1"] = a

	vm := func(name, nic string) string {
		return fmt.Sprintf(`
resource "kvm_vm" %[1]q {
  name       = %[1]q
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
%[2]s
}
`, name, nic)
	}
	lanNIC := `  network_interface {
    network = kvm_network.lan.name
  }`
	cfg := f.providerBlock() + `
resource "kvm_network" "lan" {
  name = "lan"
  mode = "nat"
  cidr = "10.88.0.0/24"
}
` + vm("a", lanNIC) + vm("b", lanNIC) + vm("web", `  network_interface {
    network = "default"
    port_forward {
      guest_port = 80
    }
  }`)

	var idA, idB, ipA, ipB, idWeb, webAddr, webPort string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{{
			Config: cfg,
			ConfigPlanChecks: resource.ConfigPlanChecks{
				PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
			},
			Check: resource.ComposeTestCheckFunc(
				captureAttr("kvm_vm.a", "id", &idA), captureAttr("kvm_vm.a", "ipv4_address", &ipA),
				captureAttr("kvm_vm.b", "id", &idB), captureAttr("kvm_vm.b", "ipv4_address", &ipB),
				captureAttr("kvm_vm.web", "id", &idWeb),
				captureAttr("kvm_vm.web", "network_interface.0.port_forward.0.host_address", &webAddr),
				captureAttr("kvm_vm.web", "network_interface.0.port_forward.0.host_port", &webPort),
				func(*terraform.State) error {
					if ipA == ipB {
						return fmt.Errorf("both VMs have address %s", ipA)
					}
					for id, ip := range map[string]string{idA: ipA, idB: ipB} {
						if err := waitForConsole(a, id, "kvm-guest-ip "+ip); err != nil {
							return fmt.Errorf("the guest does not print the address in state: %w", err)
						}
					}
					return nil
				},
				func(*terraform.State) error { return checkGuestsReachable(t, ipA, ipB) },
				func(*terraform.State) error {
					if webAddr != "127.0.0.1" {
						return fmt.Errorf("forward host_address %q, want 127.0.0.1", webAddr)
					}
					body, err := getWithin("http://"+net.JoinHostPort(webAddr, webPort)+"/", time.Minute)
					if err != nil || !strings.Contains(body, "kvm-guest") {
						return fmt.Errorf("127.0.0.1:%s does not reach the guest %s: %q, %v", webPort, idWeb, body, err)
					}
					return nil
				},
			),
		}},
	})
}

// checkGuestsReachable proves that each guest reaches the other and not
// the host (a server on the gateway address, the agent's bridge): the
// guest's /cgi-bin/get fetches a page from inside the guest.
func checkGuestsReachable(t *testing.T, ipA, ipB string) error {
	const gateway = "10.88.0.1"
	ln, err := net.Listen("tcp", net.JoinHostPort(gateway, "0"))
	if err != nil {
		return fmt.Errorf("listen on the gateway address (the agent's bridge): %w", err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "kvm-test-gateway\n")
	})}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Close() }()
	gw := ln.Addr().String()
	for from, to := range map[string]string{ipA: ipB, ipB: ipA} {
		if body, err := getWithin("http://"+from+"/cgi-bin/get?"+to, time.Minute); err != nil || !strings.Contains(body, to) {
			return fmt.Errorf("guest %s does not reach guest %s: %q, %v", from, to, body, err)
		}
		if body, err := getWithin("http://"+from+"/cgi-bin/get?"+gw, time.Minute); err != nil || !strings.Contains(body, "kvm-guest-fetch failed") {
			return fmt.Errorf("guest %s fetching from the host at the gateway %s: %q, %v; want no answer (the agent fences guests off their host)", from, gw, body, err)
		}
	}
	t.Logf("guests %s and %s reach each other, not the host at the gateway %s", ipA, ipB, gw)
	return nil
}

// getWithin GETs url until it answers 200, for at most d (a guest's DHCP
// and HTTP server come up a moment after it boots).
func getWithin(url string, d time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	hc := &http.Client{Timeout: 10 * time.Second}
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return "", err
		}
		resp, err := hc.Do(req)
		if err == nil {
			b, rerr := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK && rerr == nil {
				return string(b), nil
			}
			err = fmt.Errorf("status %d: %s", resp.StatusCode, b)
		}
		last = err
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("%s: %w (last: %v)", url, ctx.Err(), last)
		case <-time.After(time.Second):
		}
	}
}
