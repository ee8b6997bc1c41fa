package control_test

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var countLine = regexp.MustCompile(`(?m)^kvm-count ([0-9]+)\r?$`)

func consoleCounts(con string) []int {
	var out []int
	for _, m := range countLine.FindAllStringSubmatch(con, -1) {
		n, _ := strconv.Atoi(m[1])
		out = append(out, n)
	}
	return out
}

// A busybox guest that prints a counter every 100 ms, migrated live
// between two qemu agents through the control API: its id stays, it runs
// on the target with the only copy and the capacity there, and the counter
// goes on on the target's console where it stopped (no reboot: it never
// starts again from 1).
func TestQEMUMigrateBusyboxLive(t *testing.T) {
	if testing.Short() {
		t.Skip("boots real guests")
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	agents := map[string]*testenv.Agent{}
	for _, name := range []string{"h1", "h2"} {
		agents[name] = testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
		c.RegisterHost(t, name, agents[name].Address)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	script := "#!/bin/sh\ni=0\nwhile :; do i=$((i+1)); echo \"kvm-count $i\"; usleep 100000; done\n"
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "mover", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64, Host: "h1",
		UserData: script}, "")
	if err != nil {
		t.Fatal(err)
	}
	var last int
	eventually(t, "the guest counts on h1", func() bool {
		con, err := c.Client.VMConsole(ctx, vm.ID, 1<<16)
		cs := consoleCounts(con)
		if err == nil && len(cs) > 0 {
			last = cs[len(cs)-1]
		}
		return last >= 20
	})
	moved, err := c.Client.MigrateVM(ctx, vm.ID, "")
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if moved.ID != vm.ID || moved.Host != "h2" || moved.ObservedState != api.StateRunning {
		t.Fatalf("migrated vm %s on %s (%s); want %s running on h2", moved.ID, moved.Host, moved.ObservedState, vm.ID)
	}
	if _, err := agents["h1"].Client.GetVM(ctx, vm.ID); err == nil {
		t.Error("the source still has a copy after the migration")
	}
	if h := hostAllocated(t, c, "h1"); h != (api.Resources{}) {
		t.Errorf("source holds %+v after the migration", h)
	}
	checkLedger(t, c.Store)
	var (
		onTarget []int
		con      string
	)
	eventually(t, "the counter goes on on the target", func() bool {
		var err error
		con, err = agents["h2"].Client.Console(ctx, vm.ID)
		onTarget = consoleCounts(con)
		return err == nil && len(onTarget) > 0 && onTarget[len(onTarget)-1] > last+10
	})
	// The target's console starts with the migration: a guest that booted
	// again would print its ready line and count from 1.
	if strings.Contains(con, "kvm-guest-ready") || onTarget[0] < last {
		t.Fatalf("the guest restarted on the target: its counter starts at %d, the source had reached %d; console:\n%s", onTarget[0], last, con)
	}
	for i := 1; i < len(onTarget); i++ {
		if onTarget[i] != onTarget[i-1]+1 {
			t.Fatalf("the counter on the target jumps from %d to %d", onTarget[i-1], onTarget[i])
		}
	}
}
