package control_test

import (
	"slices"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// guest_agent is stored with the VM and sent to its agent (which then
// boots it cold: warm VMs have no channel); GET /v1/vms/{id} answers the
// addresses the agent reports from the guest agent on each NIC, and a VM
// without guest_agent has none of it.
func TestGuestAgentIsStoredAndItsAddressesAnswered(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})
		agent := testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{})
		c.RegisterHost(t, "h1", agent.Address)

		in := smallVM("with-agent")
		in.GuestAgent = true
		vm, err := noRetry(c).CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		if !vm.GuestAgent {
			t.Fatalf("created %+v; want guest_agent", vm)
		}
		if spec := agent.Spec(vm.ID); !spec.GuestAgent || !spec.NoWarm {
			t.Fatalf("agent spec %+v; want guest_agent and no_warm", spec)
		}
		got, err := c.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !got.GuestAgent || len(got.NetworkInterfaces[0].IPv4Addresses) != 0 {
			t.Fatalf("read before the guest agent answers: %+v; want guest_agent and no guest addresses", got)
		}
		agent.ReportGuestAddresses(vm.ID, 0, "10.0.2.15", "192.168.7.9")
		got, err = c.Client.GetVM(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		if want := []string{"10.0.2.15", "192.168.7.9"}; !slices.Equal(got.NetworkInterfaces[0].IPv4Addresses, want) {
			t.Fatalf("nics %+v; want the guest agent's addresses %v on the first", got.NetworkInterfaces, want)
		}

		plain, err := noRetry(c).CreateVM(ctx, smallVM("without-agent"), "")
		if err != nil {
			t.Fatal(err)
		}
		agent.ReportGuestAddresses(plain.ID, 0, "10.0.2.15")
		got, err = c.Client.GetVM(ctx, plain.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.GuestAgent || agent.Spec(plain.ID).GuestAgent || len(got.NetworkInterfaces[0].IPv4Addresses) != 0 {
			t.Fatalf("vm without guest_agent: %+v (agent spec %+v); want no guest agent and no guest addresses", got, agent.Spec(plain.ID))
		}
	})
}

// A fork's children inherit the source's guest_agent (their devices must
// match the snapshot's): stored with them, and on their agent, whose
// (simulated) guest agent then reports their addresses.
func TestForkChildrenInheritTheGuestAgent(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		e := startForkEnv(t, dbURL, 4096, nil)
		in := smallVM("agent-source")
		in.Host, in.GuestAgent = "h1", true
		src, err := e.c.Client.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatal(err)
		}
		f, err := e.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: src.ID, Count: 2}, "")
		if err != nil {
			t.Fatal(err)
		}
		f = e.checkFork(t, f.ID, 2)
		for _, ch := range f.Children {
			vm, err := e.c.Client.GetVM(ctx, ch.ID)
			if err != nil {
				t.Fatal(err)
			}
			if !vm.GuestAgent || !slices.Equal(vm.NetworkInterfaces[0].IPv4Addresses, []string{"10.0.2.15"}) {
				t.Fatalf("child %+v; want guest_agent and the guest agent's address on its nic", vm)
			}
		}
	})
}
