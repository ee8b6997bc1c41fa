package qemu

// Volumes (agent.Volumer): qcow2 files of the agent's volumes directory,
// attached as virtio-blk disks with the volume's serial.
//
// Every file of a volume is root's (0600, frozen bases 0400) in
// directories that only root reaches, whatever uid a VM's QEMU runs as:
// no QEMU can open a volume by its path after it dropped root (sandbox.go).
// At boot QEMU opens the volumes of its command line (-blockdev, with the
// backing chain that the qcow2 header names) as root, before -runas, like
// its own disk. A hot attach hands the running QEMU each file of the chain
// as a descriptor the agent opened (QMP add-fd, then blockdev-add on
// /dev/fdset/N with the chain spelled out), and removes the fd sets at
// once, so that the node's own descriptors are the only ones left: a
// detach (device_del, DEVICE_DELETED, blockdev-del) closes them all, which
// /proc/<pid>/fd shows.
//
// A q35 VM has MaxVolumesPerVM PCIe root ports (volport0...), one per
// volume slot, created at every boot, since q35's root bus takes no
// hot-plugged device: a volume sits in its slot's port, whether attached
// at boot or later, so that any volume can be unplugged. A microvm VM
// has no hot-plug: its volumes are attached at boot only.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qcow2"
)

var _ agent.Volumer = (*Driver)(nil)

// unplugTimeout bounds the wait for a guest to give up a disk (device_del
// needs the guest's consent: PCIe hot-plug lets it take a few seconds).
const unplugTimeout = 60 * time.Second

func volumeNode(v agent.MachineVolume) string   { return "vol-" + v.Serial }
func volumeDevice(v agent.MachineVolume) string { return "vold-" + v.Serial }
func volumePort(slot int) string                { return "volport" + strconv.Itoa(slot) }

// volumeArgs are the QEMU options of m's volume slots and its volumes at
// boot, after every other device (so that those keep their PCI addresses).
func volumeArgs(m *agent.Machine, img *image) []string {
	var args []string
	if img.Machine == "q35" {
		for s := range agent.MaxVolumesPerVM {
			args = append(args, "-device", fmt.Sprintf("pcie-root-port,id=%s,chassis=%d", volumePort(s), s+1))
		}
	}
	for _, v := range m.Volumes {
		node := "driver=qcow2,node-name=" + volumeNode(v) + ",file.driver=file,file.filename=" + qemuOptQuote(v.Path)
		// Its frozen bases spelled out, without image locks (see baseLocking).
		prefix := ""
		for _, b := range v.Backing {
			prefix += "backing."
			node += "," + prefix + "driver=qcow2," + prefix + "file.driver=file," + prefix + "file.filename=" + qemuOptQuote(b) +
				"," + prefix + "file.locking=off"
		}
		if v.ReadOnly {
			node += ",read-only=on"
		} else {
			node += ",discard=unmap"
		}
		dev := "virtio-blk-device"
		if img.Machine == "q35" {
			dev = "virtio-blk-pci,bus=" + volumePort(v.Slot)
		}
		args = append(args, "-blockdev", node,
			"-device", dev+",drive="+volumeNode(v)+",id="+volumeDevice(v)+",serial="+v.Serial)
	}
	return args
}

// baseLocking: a volume's frozen bases (volumes/.bases) are opened with
// image locking off. No process writes a base (the agent made it
// read-only, and only ever reads it), but a VM that a snapshot moved off
// a file keeps QEMU's write lock on it: QEMU reopens the old file
// read-only by its name, which a QEMU that dropped root cannot open, and
// it keeps the file as it was (it writes it no more). A fork child that
// reads the same file as its base would be refused by that lock.

// CreateVolumeDisk makes a qcow2 at path: empty, a copy of an image's
// disk grown to sizeMiB, or an overlay of a frozen base. It is written
// under a temporary name and renamed into place when complete.
func (d *Driver) CreateVolumeDisk(ctx context.Context, path string, sizeMiB int64, from agent.VolumeFrom) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	size := strconv.FormatInt(sizeMiB, 10) + "M"
	var steps [][]string
	switch {
	case from.Image != "":
		img, err := d.loadImage(from.Image)
		if err != nil {
			return err
		}
		if img.Disk == "" {
			return fmt.Errorf("image %s has no disk", from.Image)
		}
		steps = [][]string{
			{"convert", "-q", "-f", img.EffectiveDiskFormat(), "-O", "qcow2", d.path(img, img.Disk), tmp},
			{"resize", "-q", "-f", "qcow2", tmp, size},
		}
	case from.Backing != "":
		steps = [][]string{{"create", "-q", "-f", "qcow2", "-b", from.Backing, "-F", "qcow2", tmp, size}}
	default:
		steps = [][]string{{"create", "-q", "-f", "qcow2", tmp, size}}
	}
	for _, args := range steps {
		if out, err := exec.CommandContext(ctx, d.qemuImg, args...).CombinedOutput(); err != nil {
			_ = os.Remove(tmp)
			return fmt.Errorf("qemu-img %s %s: %w: %s", args[0], filepath.Base(path), err, bytes.TrimSpace(out))
		}
	}
	return os.Rename(tmp, path)
}

// ResizeVolumeDisk grows a volume that no QEMU has open.
func (d *Driver) ResizeVolumeDisk(ctx context.Context, path string, sizeMiB int64) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, d.qemuImg, "resize", "-q", "-f", "qcow2", path, strconv.FormatInt(sizeMiB<<20, 10)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img resize %s: %w: %s", path, err, bytes.TrimSpace(out))
	}
	return nil
}

// ResizeAttachedVolume grows v in the running QEMU (block_resize): the
// guest's virtio disk sees the new capacity at once.
func (d *Driver) ResizeAttachedVolume(ctx context.Context, m *agent.Machine, v agent.MachineVolume, sizeMiB int64) error {
	return d.withMonitor(ctx, m, func(q *monitor) error {
		node, err := activeVolumeNode(ctx, q, v) // a snapshot's overlay, if one moved it
		if err != nil {
			return err
		}
		return q.run(ctx, "block_resize", map[string]any{"node-name": node, "size": sizeMiB << 20}, nil)
	})
}

// AttachVolume hot-plugs v into m's running QEMU (see the top of the
// file). A volume that is there already is left alone; a node left by an
// attach that stopped half way is used.
func (d *Driver) AttachVolume(ctx context.Context, m *agent.Machine, v agent.MachineVolume) error {
	img, err := d.loadImage(m.Image)
	if err != nil {
		return err
	}
	if img.Machine != "q35" {
		return agent.ErrVolumeConflict("vm %s runs machine %s, which has no hot-plug: stop the vm, attach the volume, start it", m.ID, img.Machine)
	}
	return d.withMonitor(ctx, m, func(q *monitor) error {
		hasDev, hasNode, err := volumePresence(ctx, q, v)
		if err != nil || hasDev {
			return err
		}
		if !hasNode {
			if err := addVolumeNode(ctx, q, v); err != nil {
				return err
			}
		}
		err = q.run(ctx, "device_add", map[string]any{
			"driver": "virtio-blk-pci", "id": volumeDevice(v), "drive": volumeNode(v),
			"serial": v.Serial, "bus": volumePort(v.Slot),
		}, nil)
		if err != nil {
			_ = q.run(ctx, "blockdev-del", map[string]any{"node-name": volumeNode(v)}, nil)
			return err
		}
		return nil
	})
}

// addVolumeNode opens every file of v's chain here and hands each to QEMU
// in an fd set of its own, then adds the node on them.
func addVolumeNode(ctx context.Context, q *monitor, v agent.MachineVolume) error {
	chain := append([]string{v.Path}, v.Backing...)
	var sets []int
	defer func() {
		// The node holds descriptors of its own now (or failed): the sets'
		// copies go, so that nothing but the node keeps the files open.
		for _, s := range sets {
			_ = q.run(ctx, "remove-fd", map[string]any{"fdset-id": s}, nil)
		}
	}()
	var node map[string]any
	for i := len(chain) - 1; i >= 0; i-- {
		flags := os.O_RDONLY
		if i == 0 && !v.ReadOnly {
			flags = os.O_RDWR
		}
		f, err := os.OpenFile(chain[i], flags|syscall.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("volume %s: %w", v.ID, err)
		}
		var added struct {
			FDSetID int `json:"fdset-id"`
		}
		err = q.runWith(ctx, f, "add-fd", map[string]any{"opaque": volumeNode(v)}, &added)
		_ = f.Close()
		if err != nil {
			return err
		}
		sets = append(sets, added.FDSetID)
		file := map[string]any{"driver": "file", "filename": "/dev/fdset/" + strconv.Itoa(added.FDSetID)}
		if i > 0 {
			file["locking"] = "off" // a frozen base (see baseLocking)
		}
		n := map[string]any{"driver": "qcow2", "read-only": i > 0 || v.ReadOnly, "file": file}
		if node != nil {
			n["backing"] = node
		} else {
			n["backing"] = nil
		}
		node = n
	}
	node["node-name"] = volumeNode(v)
	if !v.ReadOnly {
		node["discard"] = "unmap"
	}
	return q.run(ctx, "blockdev-add", node, nil)
}

// volumePresence says whether v's device and its block node are in QEMU.
func volumePresence(ctx context.Context, q *monitor, v agent.MachineVolume) (dev, node bool, err error) {
	var props []struct {
		Name string `json:"name"`
	}
	if err := q.run(ctx, "qom-list", map[string]any{"path": "/machine/peripheral"}, &props); err != nil {
		return false, false, err
	}
	dev = slices.ContainsFunc(props, func(p struct {
		Name string `json:"name"`
	}) bool {
		return p.Name == volumeDevice(v)
	})
	var nodes []struct {
		NodeName string `json:"node-name"`
	}
	if err := q.run(ctx, "query-named-block-nodes", map[string]any{"flat": true}, &nodes); err != nil {
		return false, false, err
	}
	for _, n := range nodes {
		if n.NodeName == volumeNode(v) {
			node = true
		}
	}
	return dev, node, nil
}

// DetachVolume unplugs v from m's running QEMU and waits until the guest
// let it go (DEVICE_DELETED), then removes its node, which closes its
// files. Whatever of v is already gone is skipped.
func (d *Driver) DetachVolume(ctx context.Context, m *agent.Machine, v agent.MachineVolume) error {
	return d.withMonitor(ctx, m, func(q *monitor) error {
		hasDev, _, err := volumePresence(ctx, q, v)
		if err != nil {
			return err
		}
		if hasDev {
			if err := q.run(ctx, "device_del", map[string]any{"id": volumeDevice(v)}, nil); err != nil {
				return err
			}
			_, err := q.waitEvent(ctx, unplugTimeout, func(e qmpEvent) bool {
				var data struct {
					Device string `json:"device"`
				}
				return e.Event == "DEVICE_DELETED" && json.Unmarshal(e.Data, &data) == nil && data.Device == volumeDevice(v)
			})
			if err != nil {
				return fmt.Errorf("the guest of vm %s did not release volume %s within %s (device_del): %w; retry the detach, or stop the vm",
					m.ID, v.ID, unplugTimeout, err)
			}
		}
		// Every node of it: a snapshot put overlays on top (volume_fork.go).
		// A node made by -blockdev goes with its device on some QEMUs; one
		// that is gone is what we want.
		return deleteVolumeNodes(ctx, q, v)
	})
}

// ExportVolumeDisk writes v as one qcow2 at dst, its frozen bases folded
// in (qemu-img convert), so that another agent can take it alone. A
// read-only v is a frozen point, read without image locks.
func (d *Driver) ExportVolumeDisk(ctx context.Context, v agent.MachineVolume, dst string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Minute)
	defer cancel()
	args := []string{"convert", "-q", "-f", "qcow2", "-O", "qcow2", v.Path, dst}
	if v.ReadOnly {
		// A snapshot's frozen point (agent volume_fork.go): files that no
		// process writes, read past the lock a parent keeps (baseLocking).
		args = append([]string{"convert", "-U"}, args[1:]...)
	}
	out, err := exec.CommandContext(ctx, d.qemuImg, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img convert %s: %w: %s", v.Path, err, bytes.TrimSpace(out))
	}
	return nil
}

// CheckPulledVolumeDisk refuses a pulled file that is not a plain qcow2
// (qcow2.ReadHeader: no external data file, no encryption) or that names
// a backing file: an export is one self-contained file.
func (d *Driver) CheckPulledVolumeDisk(_ context.Context, path string) error {
	h, err := qcow2.ReadHeader(path)
	if err != nil {
		return err
	}
	if h.BackingFilename != "" {
		return fmt.Errorf("the pulled disk names backing file %q; an exported volume names none", h.BackingFilename)
	}
	return nil
}
