package qemu

// Freezing a running VM's volumes for a snapshot (agent volume_fork.go).
//
// A volume's files are root's in directories QEMU cannot reach once it
// dropped root (volume.go), so blockdev-snapshot-sync, which makes QEMU
// open the overlay by its name, cannot move a volume the way the VM's own
// disk moves. Instead the agent opens the overlay and hands QEMU its
// descriptor (add-fd), QEMU adds it as a node of its own with no backing
// (blockdev-add, backing null, on /dev/fdset/N), and blockdev-snapshot
// installs the volume's active node as its backing and moves the guest's
// disk onto it: the old file is read and never written again. The
// overlay's header names the frozen file as a base already (the agent made
// it so), which is what the next boot reads.
//
// The overlay's node is vol-<serial>-g<n> for the overlay disk.<n>.qcow2.
// The active node of a volume is found through its device (query-block,
// qdev), never from the agent's record: QEMU is the truth, also when the
// agent died between recording a move and making it. A detach removes
// every node of the volume, newest first.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// volumeGenNode is the node of the overlay file next of volume v.
func volumeGenNode(v agent.MachineVolume, next string) string {
	g := 0
	if sm := diskFilePattern.FindStringSubmatch(filepath.Base(next)); sm != nil {
		g, _ = strconv.Atoi(sm[1])
	}
	return volumeNode(v) + "-g" + strconv.Itoa(g)
}

// activeVolumeNode is the node the guest's disk of v reads and writes now.
func activeVolumeNode(ctx context.Context, q *monitor, v agent.MachineVolume) (string, error) {
	var blocks []struct {
		QDev     string `json:"qdev"`
		Inserted *struct {
			NodeName string `json:"node-name"`
		} `json:"inserted"`
	}
	if err := q.run(ctx, "query-block", nil, &blocks); err != nil {
		return "", err
	}
	dev := volumeDevice(v)
	for _, b := range blocks {
		if b.Inserted == nil {
			continue
		}
		if b.QDev == dev || strings.Contains(b.QDev, "/"+dev+"/") || strings.HasSuffix(b.QDev, "/"+dev) {
			return b.Inserted.NodeName, nil
		}
	}
	return "", fmt.Errorf("volume %s: qemu has no device %s", v.ID, dev)
}

// volumeNodes are the named nodes of v in QEMU, newest first.
func volumeNodes(ctx context.Context, q *monitor, v agent.MachineVolume) ([]string, error) {
	var nodes []struct {
		NodeName string `json:"node-name"`
	}
	if err := q.run(ctx, "query-named-block-nodes", map[string]any{"flat": true}, &nodes); err != nil {
		return nil, err
	}
	base := volumeNode(v)
	gen := func(name string) int {
		g, _ := strconv.Atoi(strings.TrimPrefix(name, base+"-g"))
		return g
	}
	var out []string
	for _, n := range nodes {
		if n.NodeName == base || strings.HasPrefix(n.NodeName, base+"-g") {
			if !slices.Contains(out, n.NodeName) {
				out = append(out, n.NodeName)
			}
		}
	}
	slices.SortFunc(out, func(a, b string) int {
		ga, gb := -1, -1
		if a != base {
			ga = gen(a)
		}
		if b != base {
			gb = gen(b)
		}
		return gb - ga
	})
	return out, nil
}

// switchVolume moves the stopped VM's disk of sw.Volume onto sw.Next.
func switchVolume(ctx context.Context, q *monitor, sw agent.VolumeSwitch) error {
	v := sw.Volume
	active, err := activeVolumeNode(ctx, q, v)
	if err != nil {
		return err
	}
	node := volumeGenNode(v, sw.Next)
	if node == active {
		return nil // moved already (a retried call)
	}
	nodes, err := volumeNodes(ctx, q, v)
	if err != nil {
		return err
	}
	if slices.Contains(nodes, node) {
		// Left by a move that failed after it added the node.
		if err := q.run(ctx, "blockdev-del", map[string]any{"node-name": node}, nil); err != nil {
			return fmt.Errorf("volume %s: remove the node %s a failed snapshot left: %w", v.ID, node, err)
		}
	}
	f, err := os.OpenFile(sw.Next, os.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	var added struct {
		FDSetID int `json:"fdset-id"`
	}
	err = q.runWith(ctx, f, "add-fd", map[string]any{"opaque": node}, &added)
	_ = f.Close()
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	err = q.run(ctx, "blockdev-add", map[string]any{
		"driver": "qcow2", "node-name": node, "discard": "unmap", "backing": nil,
		"file": map[string]any{"driver": "file", "filename": "/dev/fdset/" + strconv.Itoa(added.FDSetID)},
	}, nil)
	// The node has its own descriptor now (or failed): the set's goes.
	_ = q.run(ctx, "remove-fd", map[string]any{"fdset-id": added.FDSetID}, nil)
	if err != nil {
		return fmt.Errorf("volume %s: add its overlay: %w", v.ID, err)
	}
	if err := q.run(ctx, "blockdev-snapshot", map[string]any{"node": active, "overlay": node}, nil); err != nil {
		_ = q.run(ctx, "blockdev-del", map[string]any{"node-name": node}, nil)
		return fmt.Errorf("volume %s: move it onto its overlay: %w", v.ID, err)
	}
	return nil
}

// deleteVolumeNodes removes every node of v (after its device is gone),
// newest first, so that each one's backing is free when its turn comes.
func deleteVolumeNodes(ctx context.Context, q *monitor, v agent.MachineVolume) error {
	nodes, err := volumeNodes(ctx, q, v)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		if err := q.run(ctx, "blockdev-del", map[string]any{"node-name": n}, nil); err != nil {
			return fmt.Errorf("volume %s: remove node %s: %w", v.ID, n, err)
		}
	}
	return nil
}
