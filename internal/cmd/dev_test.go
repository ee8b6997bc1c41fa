package cmd

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// kvmd dev must come up with its local agent registered and schedulable, so
// that a VM can be created right away, and shut both servers down on cancel.
func TestRunDevServesControlWithLocalHost(t *testing.T) {
	addr := freeAddress(t)
	env := map[string]string{"KVMD_TOKEN": "dev-token"}
	args := []string{"--listen", addr, "--data-dir", t.TempDir(), "--driver", "sim"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs syncBuffer
	done := make(chan error, 1)
	go func() { done <- runDev(ctx, args, func(k string) string { return env[k] }, &logs) }()

	c := client.New(addr, "dev-token", client.WithTimeout(10*time.Second), client.WithRetries(0, 0))
	var host api.Host
	var err error
	for i := 0; i < 200; i++ {
		if host, err = c.GetHost(ctx, "local"); err == nil && host.Alive {
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	if err != nil || !host.Alive || host.Driver != "sim" {
		t.Fatalf("host local = %+v, %v; want an alive sim host; logs:\n%s", host, err, logs.String())
	}
	vm, err := c.CreateVM(ctx, api.VMCreate{Name: "dev-vm", Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}, "")
	if err != nil {
		t.Fatalf("create on kvmd dev: %v; logs:\n%s", err, logs.String())
	}
	if vm.Host != "local" || vm.ObservedState != api.StateRunning {
		t.Fatalf("vm = %+v, want running on local", vm)
	}
	if !strings.Contains(logs.String(), "KVM_TOKEN=dev-token") {
		t.Fatalf("kvmd dev did not print the token it uses; logs:\n%s", logs.String())
	}

	cancel()
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("runDev after cancel: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("runDev did not return after its context ended")
	}
}

func TestRunDevRefusesUnknownDriver(t *testing.T) {
	err := runDev(context.Background(), []string{"--driver", "xen", "--data-dir", t.TempDir()}, func(string) string { return "" }, &syncBuffer{})
	if err == nil || !strings.Contains(err.Error(), "xen") {
		t.Fatalf("runDev with driver xen: %v, want an error naming it", err)
	}
}
