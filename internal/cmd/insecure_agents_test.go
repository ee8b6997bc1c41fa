package cmd

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// TestInsecureAgentAddressesNeedTheFlag: the agent token travels to every
// agent, so an http:// agent address off loopback is refused (400 invalid,
// saying what to do) unless kvmd control runs with --allow-insecure-agents
// (or KVMD_ALLOW_INSECURE_AGENTS). Loopback stays allowed, as kvmd dev and
// make demo use it. The off-loopback agent listens on an address of a
// address of the test's own network namespace.
func TestInsecureAgentAddressesNeedTheFlag(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	// The namespace's lo carries the LAN address: no kernel module needed,
	// and to the control plane it is an address off loopback all the same.
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	addr, err := netlink.ParseAddr("10.99.0.1/32")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.AddrAdd(lo, addr); err != nil {
		t.Fatal(err)
	}
	simAgent := func(listen string) string {
		return startServer(t, agentRunner, []string{"--listen", listen, "--state-dir", t.TempDir(), "--driver", "sim",
			"--vcpus", "2", "--memory-mib", "2048", "--disk-mib", "10000", "--token", "agent-secret"}, "kvmd agent listening")
	}
	lanAgent := "http://" + simAgent("10.99.0.1:0")
	_, port, err := net.SplitHostPort(strings.TrimPrefix(lanAgent, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	loopAgent := "http://" + simAgent("127.0.0.1:0")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	strict := client.New("http://"+startServer(t, controlRunner, []string{"--listen", "127.0.0.1:0", "--data-dir", t.TempDir(),
		"--token", "control-secret", "--agent-token", "agent-secret"}, "control API listening"), "control-secret", client.WithRetries(0, 0))
	for _, address := range []string{lanAgent, "http://[fd00::1]:" + port, "http://kvm-01.example.net:" + port} {
		_, err := strict.PutHost(ctx, "lan", api.HostPut{Address: address})
		var e *client.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Code != api.CodeInvalid ||
			!strings.Contains(e.Message, "https://") || !strings.Contains(e.Message, "--allow-insecure-agents") {
			t.Errorf("register an agent at %s without --allow-insecure-agents: %v; want 400 invalid saying to use https:// or --allow-insecure-agents", address, err)
		}
	}
	if _, err := strict.GetHost(ctx, "lan"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("a refused registration left host lan: %v", err)
	}
	if h, err := strict.PutHost(ctx, "loop", api.HostPut{Address: loopAgent}); err != nil || !h.Alive {
		t.Errorf("register an agent at the loopback address %s: %+v %v; want it registered", loopAgent, h, err)
	}

	lenient := client.New("http://"+startServer(t, controlRunner, []string{"--listen", "127.0.0.1:0", "--data-dir", t.TempDir(),
		"--token", "control-secret", "--agent-token", "agent-secret", "--allow-insecure-agents"}, "control API listening"),
		"control-secret", client.WithRetries(0, 0))
	if h, err := lenient.PutHost(ctx, "lan", api.HostPut{Address: lanAgent}); err != nil || !h.Alive {
		t.Errorf("register an agent at %s with --allow-insecure-agents: %+v %v; want it registered", lanAgent, h, err)
	}
}
