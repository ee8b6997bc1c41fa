package qemu_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// flattenDepth is the disk chain depth of the agent in
// TestSnapshotChainFlattenedPastDepth: small, so that a few snapshots pass it.
const flattenDepth = 3

// flattenWriter is the user data of the guest in that test: in the
// background it writes block n of its disk (4 KiB, "kvm-flatten-<n>") once
// a second, synced, and says so on the console, so that every disk file of
// the chain holds blocks of its own.
const flattenWriter = `#!/bin/sh
(
n=0
while [ $n -lt 1200 ]; do
	printf 'kvm-flatten-%06d\n' $n | dd of=/dev/vda bs=4096 seek=$n conv=notrunc,fsync 2>/dev/null || exit 1
	echo "kvm-flatten-wrote $n"
	n=$((n+1))
	sleep 1
done
) &
`

var flattenWrote = regexp.MustCompile(`(?m)^kvm-flatten-wrote ([0-9]+)\r?$`)

// startFlattenAgent is an agent on a real QEMU driver with a disk chain
// depth of flattenDepth.
func startFlattenAgent(t *testing.T, dir string) (*agentapi.Client, func()) {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("KVM_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(t), Accel: testenv.Accel(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Config{StateDir: dir, Driver: d, Token: "agent-token", Logger: log, DiskChainDepth: flattenDepth})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(a.Handler())
	stop := func() {
		srv.Close()
		_ = a.Close()
	}
	t.Cleanup(func() {
		stop()
		for _, pid := range qemu.ProcessesUnder(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return agentapi.NewClient(srv.URL, "agent-token"), stop
}

// flattenLastWrite is the last block the guest of that test says it wrote.
func flattenLastWrite(con string) int {
	all := flattenWrote.FindAllStringSubmatch(con, -1)
	if len(all) == 0 {
		return -1
	}
	n, _ := strconv.Atoi(all[len(all)-1][1])
	return n
}

// flattenChain is the backing chain of the disk file the vm in dir writes
// to (the newest generation), as qemu-img info --backing-chain lists it:
// the vm's own files, then its image's base disk.
func flattenChain(t *testing.T, dir string) []string {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "disk*.qcow2"))
	top, gen := "", -1
	for _, f := range files {
		g := 0
		if m := regexp.MustCompile(`^disk\.([0-9]+)\.qcow2$`).FindStringSubmatch(filepath.Base(f)); m != nil {
			g, _ = strconv.Atoi(m[1])
		}
		if g > gen {
			top, gen = f, g
		}
	}
	out, err := exec.Command("qemu-img", "info", "-U", "--backing-chain", "--output=json", top).Output()
	if err != nil {
		t.Fatalf("qemu-img info --backing-chain %s: %v", top, err)
	}
	var chain []struct {
		Filename string `json:"filename"`
	}
	if err := json.Unmarshal(out, &chain); err != nil {
		t.Fatalf("qemu-img info: %v: %s", err, out)
	}
	var names []string
	for _, c := range chain {
		names = append(names, c.Filename)
	}
	return names
}

// flattenOwn counts the files of chain in the vm's directory dir (not its
// image's base disk, if it has one).
func flattenOwn(chain []string, dir string) int {
	n := 0
	for _, f := range chain {
		if filepath.Dir(filepath.Clean(f)) == filepath.Clean(dir) {
			n++
		}
	}
	return n
}

// TestSnapshotChainFlattenedPastDepth: a running guest snapshotted more
// times than the disk chain depth keeps at most that many files of its own in its
// disk chain (beside its image's base disk), streamed in the background while
// it runs (QMP block-stream); no snapshot lists more disk files than the
// depth, so no pull moves more; the guest keeps running and writing, and
// every block it wrote, in whichever file of the chain it landed, is on its
// disk after it stopped.
func TestSnapshotChainFlattenedPastDepth(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	c, _ := startFlattenAgent(t, dir)
	spec := guest
	spec.Seed = &agentapi.SeedSpec{InstanceID: "src", Hostname: "src", UserData: flattenWriter}
	if _, err := c.CreateVM(ctx, "src", spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	vmDir := filepath.Join(dir, "vms", "src")
	// waitWrite waits until the guest wrote a block past after.
	waitWrite := func(after int) int {
		t.Helper()
		deadline := time.Now().Add(bootWait)
		for {
			con, err := c.Console(ctx, "src")
			if err != nil {
				t.Fatal(err)
			}
			if n := flattenLastWrite(con); n > after {
				return n
			}
			if time.Now().After(deadline) {
				t.Fatalf("the guest wrote no block past %d within %s; console:\n%s", after, bootWait, con)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	last := waitWrite(-1)
	snaps := flattenDepth + 3
	for i := range snaps {
		// Each generation of the disk gets blocks of its own.
		last = waitWrite(last)
		s, err := c.CreateSnapshot(ctx, "s"+strconv.Itoa(i), agentapi.SnapshotSpec{VMID: "src"})
		if err != nil {
			t.Fatalf("snapshot %d: %v", i, err)
		}
		disks := 0
		for _, f := range s.Files {
			if f.Kind == agentapi.SnapshotFileDisk || f.Kind == agentapi.SnapshotFileBacking {
				disks++
			}
		}
		if disks > flattenDepth {
			t.Errorf("snapshot %d lists %d disk files, more than the depth %d: a pull of it would move them all", i, disks, flattenDepth)
		}
		if vm, err := c.GetVM(ctx, "src"); err != nil || vm.State != agentapi.StateRunning {
			t.Fatalf("vm after snapshot %d = %+v, %v; want running", i, vm, err)
		}
	}
	// The chain is flattened in the background: wait for it, bounded.
	deadline := time.Now().Add(bootWait)
	chain := flattenChain(t, vmDir)
	for flattenOwn(chain, vmDir) > flattenDepth && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		chain = flattenChain(t, vmDir)
	}
	if n := flattenOwn(chain, vmDir); n > flattenDepth {
		t.Fatalf("after %d snapshots the vm's disk chain has %d files of its own (%v), want at most the depth %d",
			snaps, n, chain, flattenDepth)
	}
	// Still running, still writing.
	waitWrite(waitWrite(last))
	if vm, err := c.GetVM(ctx, "src"); err != nil || vm.State != agentapi.StateRunning {
		t.Fatalf("vm after the flatten = %+v, %v; want running", vm, err)
	}
	if _, err := c.Action(ctx, "src", agentapi.ActionStop); err != nil {
		t.Fatalf("stop: %v", err)
	}
	con, err := c.Console(ctx, "src")
	if err != nil {
		t.Fatal(err)
	}
	last = flattenLastWrite(con)
	chain = flattenChain(t, vmDir)
	raw := filepath.Join(t.TempDir(), "disk.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", chain[0], raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert %s: %v: %s", chain[0], err, out)
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	for n := 0; n <= last; n++ {
		want := fmt.Sprintf("kvm-flatten-%06d\n", n)
		if got := b[n*4096 : n*4096+len(want)]; !bytes.Equal(got, []byte(want)) {
			t.Fatalf("block %d of the stopped vm's disk (chain %v) = %q, want %q: a write was lost", n, chain, got, want)
		}
	}
}
