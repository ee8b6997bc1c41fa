package qemu_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A guest that floods its serial console leaves a console log no larger
// than the agent's cap (plus what the guest writes in one trim interval):
// the start of the boot and the latest lines stay, the guest status still
// reads from it, and the host's disk accounting counts the cap per VM.
func TestFloodedConsoleLogStaysWithinItsCap(t *testing.T) {
	t.Parallel()
	const (
		limit    = 128 << 10
		interval = 200 * time.Millisecond
		// slack is what the guest may write between two trims: far more
		// than a TCG guest's serial port gets through in one interval.
		slack = 256 << 10
		// lines of about 70 bytes: 560 KB, more than limit+slack, so an
		// untrimmed log fails the test; kept small, as TCG's serial port is slow.
		lines = 8000
	)
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ConsoleLogBytes: limit, ConsoleTrimInterval: interval})
	ctx := context.Background()
	userData := "#!/bin/sh\n" +
		"i=0\n" +
		"while [ $i -lt " + strconv.Itoa(lines) + " ]; do echo \"flood line $i ................................................\"; i=$((i + 1)); done >/dev/console\n" +
		"echo flood-done >/dev/console\n"
	spec := guest
	spec.Seed = &agentapi.SeedSpec{InstanceID: "flood", Hostname: "flood", UserData: userData}
	if _, err := a.Client.CreateVM(ctx, "flood", spec); err != nil {
		t.Fatal(err)
	}
	info, err := a.Client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := spec.DiskMiB + 1; info.Allocated.DiskMiB != want {
		t.Errorf("info allocated disk %d MiB with one vm of disk_mib %d and a console cap of %d KiB; want %d (the cap and qemu.log's 64 KiB counted per vm)",
			info.Allocated.DiskMiB, spec.DiskMiB, limit>>10, want)
	}

	path := filepath.Join(a.StateDir, "vms", "flood", "console.log")
	largest := int64(0)
	deadline := time.Now().Add(10 * time.Minute)
	for {
		if fi, err := os.Stat(path); err == nil {
			largest = max(largest, fi.Size())
		}
		con, err := a.Client.ConsoleTail(ctx, "flood", 4096)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(con, "flood-done") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the guest did not finish its flood; console tail:\n%s", con)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if largest > limit+slack {
		t.Errorf("console log reached %d bytes during the flood; want at most the cap %d plus %d", largest, limit, slack)
	}
	time.Sleep(3 * interval)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > limit+4096 {
		t.Errorf("console log is %d bytes after the flood; want at most the cap %d (and a few ticks)", len(b), limit)
	}
	con := string(b)
	for _, want := range []string{agent.ConsoleBootMarker + "flood", "kvm-guest-init uptime", "kvm-agent: console log trimmed:",
		"flood line " + strconv.Itoa(lines-1) + " ", "flood-done"} {
		if !strings.Contains(con, want) {
			t.Errorf("console log lacks %q", want)
		}
	}
	if strings.Contains(con, "flood line 1000 ") {
		t.Errorf("console log still holds an early flood line: not trimmed")
	}
	// The guest status reads the trimmed log: the seed lines of the head,
	// cloud-init's final line of the tail.
	sum := sha256.Sum256([]byte(userData))
	g, err := a.Client.Guest(ctx, "flood")
	if err != nil || g.CloudInit != agentapi.CloudInitDone || g.UserDataSHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("guest status of the trimmed log = %+v, %v; want cloud-init done and the user data's digest", g, err)
	}
	if t.Failed() {
		t.Logf("console log (%d bytes), head:\n%s", len(con), con[:min(len(con), 2048)])
	}
}
