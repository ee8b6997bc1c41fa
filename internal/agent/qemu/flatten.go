package qemu

// Flattening a VM's disk chain (agent.DiskFlattener; why: the agent's
// disk_chain.go). The chain of a VM's own files is disk.<n>.qcow2 (the
// file it writes) on the generations below it, down to the oldest,
// disk.qcow2 (on its image's base disk, or on the frozen disk of the
// snapshot a child started from). Flattening moves the data of every file
// between the newest and the oldest into the newest, which then sits on the
// oldest directly: two files, whatever the depth, so that the next
// flatten is depth-2 snapshots away. For a running or paused VM QEMU does
// it (block-stream, the guest running on meanwhile); for a stopped one,
// qemu-img rebase, which copies what differs. The files left out of the
// chain leave the VM's directory; the snapshots that froze them keep their
// own hard links, and the names in those files are relative, so their
// chains still resolve there.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
)

var _ agent.DiskFlattener = (*Driver)(nil)

const (
	// flattenJob is the block-stream job of a flatten.
	flattenJob = "flatten-disk0"
	// flattenPoll is how often a flatten asks QEMU whether its job ended.
	flattenPoll = 50 * time.Millisecond
)

// ownChain is the disk chain of the VM in dir from its file top down, as
// far as it is the VM's own files: plain disk chain names (diskFile) in
// dir. It ends where a backing name is anything else (an image's base
// disk, a snapshot's file) or there is none.
func ownChain(dir, top string) ([]string, error) {
	chain := []string{top}
	for {
		name := chain[len(chain)-1]
		h, err := qcow2.ReadHeader(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		bf := h.BackingFilename
		if bf == "" || strings.ContainsAny(bf, `/\:`) || !diskFilePattern.MatchString(bf) {
			return chain, nil
		}
		if slices.Contains(chain, bf) {
			return nil, fmt.Errorf("disk %s: its backing chain loops at %s", top, bf)
		}
		chain = append(chain, bf)
	}
}

// FlattenDisk implements agent.DiskFlattener (see the file comment).
func (d *Driver) FlattenDisk(ctx context.Context, m *agent.Machine, depth int) (int, int, error) {
	if m.DiskMiB == 0 {
		return 0, 0, nil
	}
	top := filepath.Base(diskPath(m))
	chain, err := ownChain(m.Dir, top)
	if err != nil {
		return 0, 0, fmt.Errorf("disk chain of vm %s: %w", m.ID, err)
	}
	before := len(chain)
	if before <= depth || before <= 2 {
		return before, before, nil
	}
	oldest := chain[before-1]
	if alive, _ := checkProcess(m.Process, pidfileOf(m)); alive {
		err = d.streamDisk(ctx, m, oldest)
	} else {
		err = d.rebaseDisk(ctx, m, top, oldest)
	}
	if err != nil {
		return before, before, fmt.Errorf("flatten the disk chain of vm %s (%d files, depth %d): %w", m.ID, before, depth, err)
	}
	// The header is the proof: the newest file now names the oldest.
	h, err := qcow2.ReadHeader(filepath.Join(m.Dir, top))
	if err != nil {
		return before, before, fmt.Errorf("flatten the disk chain of vm %s: %w", m.ID, err)
	}
	if h.BackingFilename != oldest {
		return before, before, fmt.Errorf("flatten the disk chain of vm %s: %s still names %q, want %s", m.ID, top, h.BackingFilename, oldest)
	}
	for _, name := range chain[1 : before-1] {
		if err := os.Remove(filepath.Join(m.Dir, name)); err != nil && !os.IsNotExist(err) {
			d.log.Warn("remove a disk file the vm's chain no longer uses", "vm", m.ID, "file", name, "err", err)
		}
	}
	return before, 2, nil
}

// streamDisk streams the files above oldest into the file m's QEMU writes
// (block-stream), and waits for the job to end. A job an earlier flatten
// left running (its agent closed) is waited for instead of started again.
func (d *Driver) streamDisk(ctx context.Context, m *agent.Machine, oldest string) error {
	return d.withMonitor(ctx, m, func(q *monitor) error {
		job, err := q.blockJob(ctx, flattenJob)
		if err != nil {
			return err
		}
		if job == nil {
			// After a migration (a snapshot that kept the VM paused is one)
			// QEMU has let go of its images until the VM runs again: no job
			// may write them then.
			st, err := q.queryStatus(ctx)
			if err != nil {
				return err
			}
			if st.Status != "running" && st.Status != "paused" {
				return fmt.Errorf("qemu is %s, its disk not writable until the vm runs again: the flatten is left to the next snapshot", st.Status)
			}
			base, err := formatNode(ctx, q, filepath.Join(m.Dir, oldest))
			if err != nil {
				return err
			}
			// The name written into the newest file's header is the plain
			// one, as every name in the chain, so that a snapshot that
			// freezes it resolves it in its own directory.
			if err := q.run(ctx, "block-stream", map[string]any{
				"job-id": flattenJob, "device": driveID, "base-node": base, "backing-file": oldest,
			}, nil); err != nil {
				return fmt.Errorf("block-stream onto %s: %w", oldest, err)
			}
		}
		for {
			job, err := q.blockJob(ctx, flattenJob)
			if err != nil {
				return err
			}
			if job == nil {
				return nil // ended; FlattenDisk checks the header
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("block-stream onto %s: %w (%d of %d bytes)", oldest, ctx.Err(), job.Offset, job.Len)
			case <-time.After(flattenPoll):
			}
		}
	})
}

// formatNode is the name of the qcow2 node QEMU opened the file path as.
func formatNode(ctx context.Context, q *monitor, path string) (string, error) {
	var nodes []struct {
		NodeName string `json:"node-name"`
		Driver   string `json:"drv"`
		File     string `json:"file"`
	}
	if err := q.run(ctx, "query-named-block-nodes", map[string]any{"flat": true}, &nodes); err != nil {
		return "", err
	}
	for _, n := range nodes {
		if n.Driver == "qcow2" && filepath.Clean(blockFileName(n.File)) == filepath.Clean(path) {
			return n.NodeName, nil
		}
	}
	return "", fmt.Errorf("qemu has no qcow2 node of %s", path)
}

// rebaseDisk puts top on oldest with qemu-img rebase, which copies into
// top every cluster where the chain between them differs from oldest: the
// VM is stopped, nothing else has the files open.
func (d *Driver) rebaseDisk(ctx context.Context, m *agent.Machine, top, oldest string) error {
	cmd := exec.CommandContext(ctx, d.qemuImg, "rebase", "-q", "-f", "qcow2", "-b", oldest, "-F", "qcow2", top)
	cmd.Dir = m.Dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img rebase %s onto %s: %w: %s", top, oldest, err, bytes.TrimSpace(out))
	}
	return nil
}
