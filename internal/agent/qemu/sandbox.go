package qemu

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// QEMU's sandbox: each QEMU runs under QEMU's seccomp filter and, when the
// agent is root, as a uid and gid of its own VM (-runas uid:gid), so that a
// guest that takes QEMU over holds only that VM's files.
//
// QEMU 7.2 installs its filter before it would daemonize and before -runas
// calls setgid/setuid: spawn=deny would kill -daemonize's fork, and
// elevateprivileges=deny the uid change (both with SIGSYS). So the agent
// starts QEMU in a process group of its own without -daemonize (spawn=deny: no
// fork, no exec of a shell), and denies uid changes only when QEMU keeps
// the agent's uid; with -runas the dropped uid cannot take root back.
//
// QEMU opens every file of its command line (disks and their backing
// chain, a child's RAM image, the console log, taps, the QMP socket, the
// pid file, /dev/kvm) as root before it drops privileges. After the drop it
// opens only a snapshot's new overlay (blockdev-snapshot-sync) and reopens
// the disk it moves off read-only; both are its own VM's. Descriptors the
// agent hands it over QMP (getfd) need no access at all.
//
// Files, for a VM whose QEMU runs as uid U (group U):
//
//	the VM's directory     root:U 0750: QEMU reaches its files, lists none
//	                       of another VM's, and creates nothing (its
//	                       metadata stays the agent's)
//	the disk QEMU writes   U:U 0600
//	efivars.fd             U:U 0600: a uefi VM's variables, which QEMU
//	                       writes (firmware.go); the firmware's code is
//	                       read-only in /usr/share/OVMF
//	frozen disks           root 0444 once a snapshot holds them
//	console.log, seed.iso  root: opened by QEMU before the drop
//	qemu.uid               root 0644: U, the VM's identity (below)
const (
	// qemuSandbox is QEMU's -sandbox option; elevateprivileges=deny is
	// added when QEMU does not drop to a uid of its own (see above).
	qemuSandbox = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"

	// DefaultUIDBase and DefaultUIDCount are the uids (and gids) the agent
	// gives its VMs' QEMU processes: far above any system or login uid,
	// and below the ranges container runtimes map.
	DefaultUIDBase  = 2_000_000_000
	DefaultUIDCount = 1_000_000

	// uidFileName, in a VM's directory, holds the uid its QEMU runs as: it
	// moves with the directory (a warm VM handed to a new id keeps its
	// uid), survives an agent restart, and a fork child gets its own.
	uidFileName = "qemu.uid"
	// uidsDirName is the directory beside the agent's vms and pool
	// directories where each uid in use is a hard link of its VM's
	// qemu.uid: a uid whose link count fell to 1 belongs to a deleted VM
	// and is free again.
	uidsDirName = "qemu-uids"
)

// sandboxArgs are the QEMU options that sandbox it, for a QEMU that runs as
// uid (0: the agent is not root, QEMU runs as the agent's user).
func sandboxArgs(uid uint32) []string {
	if uid == 0 {
		return []string{"-sandbox", qemuSandbox + ",elevateprivileges=deny"}
	}
	return []string{"-sandbox", qemuSandbox, "-runas", fmt.Sprintf("%d:%d", uid, uid)}
}

// uidsDir is the uid registry of the agent that keeps m: the agent's state
// directory holds the VMs' parent directories (vms/<id>, pool/<id>).
func uidsDir(m *agent.Machine) string {
	return filepath.Join(filepath.Dir(filepath.Dir(m.Dir)), uidsDirName)
}

// vmUID returns the uid m's QEMU runs as: the one in its qemu.uid, or a free
// one of the driver's range, recorded there and in the registry.
func (d *Driver) vmUID(m *agent.Machine) (uint32, error) {
	d.uidMu.Lock()
	defer d.uidMu.Unlock()
	reg := uidsDir(m)
	if err := os.MkdirAll(reg, 0o700); err != nil {
		return 0, fmt.Errorf("uid of vm %s: %w", m.ID, err)
	}
	path := filepath.Join(m.Dir, uidFileName)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		uid, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
		if err != nil || uid == 0 {
			return 0, fmt.Errorf("uid of vm %s: %s holds %q, not a uid; delete the vm", m.ID, path, b)
		}
		return uint32(uid), claimUID(path, reg, uint32(uid))
	case !errors.Is(err, fs.ErrNotExist):
		return 0, fmt.Errorf("uid of vm %s: %w", m.ID, err)
	}
	tmp := path + ".tmp"
	for i := range d.opts.UIDCount {
		uid := d.opts.UIDBase + (d.uidNext+i)%d.opts.UIDCount
		// A new file for each try: a link left by an earlier try (or a
		// crash) then names a file nobody else links, which frees its uid.
		_ = os.Remove(tmp)
		if err := os.WriteFile(tmp, []byte(strconv.FormatUint(uint64(uid), 10)+"\n"), 0o644); err != nil {
			return 0, fmt.Errorf("uid of vm %s: %w", m.ID, err)
		}
		err := claimUID(tmp, reg, uid)
		if errors.Is(err, errUIDTaken) {
			continue
		}
		if err == nil {
			err = os.Rename(tmp, path)
		}
		if err != nil {
			_ = os.Remove(tmp)
			return 0, fmt.Errorf("uid of vm %s: %w", m.ID, err)
		}
		d.uidNext = (d.uidNext + i + 1) % d.opts.UIDCount
		return uid, nil
	}
	_ = os.Remove(tmp)
	return 0, fmt.Errorf("uid of vm %s: all %d uids from %d are taken by vms; raise --qemu-uid-count", m.ID, d.opts.UIDCount, d.opts.UIDBase)
}

var errUIDTaken = errors.New("uid taken")

// claimUID links file (a VM's qemu.uid) into the registry as uid. A link
// there already is file's own, or a deleted VM's (its only link: taken
// over), or another VM's: errUIDTaken.
func claimUID(file, reg string, uid uint32) error {
	link := filepath.Join(reg, strconv.FormatUint(uint64(uid), 10))
	for range 2 {
		err := os.Link(file, link)
		if err == nil || !errors.Is(err, fs.ErrExist) {
			return err
		}
		have, err := os.Stat(link)
		if err != nil {
			return err
		}
		mine, err := os.Stat(file)
		if err != nil {
			return err
		}
		if os.SameFile(have, mine) {
			return nil
		}
		if st, ok := have.Sys().(*syscall.Stat_t); !ok || st.Nlink > 1 {
			return fmt.Errorf("%w: %s", errUIDTaken, link)
		}
		if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return fmt.Errorf("%w: %s", errUIDTaken, link)
}

// prepareFiles gives m's files to its QEMU's uid (see the table above)
// before QEMU starts: its directory to the uid's group, read-only, and the
// disk it writes to the uid. The directories above m.Dir must let any user
// through (search, not list): QEMU opens a snapshot's new overlay by its
// path after dropping root.
func (d *Driver) prepareFiles(m *agent.Machine, uid uint32) error {
	if err := d.searchableUp(filepath.Dir(m.Dir)); err != nil {
		return fmt.Errorf("vm %s: %w", m.ID, err)
	}
	if err := os.Chown(m.Dir, 0, int(uid)); err != nil {
		return fmt.Errorf("vm %s: give its directory to its qemu's group: %w", m.ID, err)
	}
	if err := os.Chmod(m.Dir, 0o750); err != nil {
		return fmt.Errorf("vm %s: %w", m.ID, err)
	}
	if m.DiskMiB > 0 {
		if err := chownWritable(diskPath(m), uid); err != nil {
			return fmt.Errorf("vm %s: give its disk to its qemu's uid: %w", m.ID, err)
		}
	}
	if err := chownWritable(varsPath(m), uid); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("vm %s: give its uefi variables to its qemu's uid: %w", m.ID, err)
	}
	return nil
}

// chownWritable gives path to uid (and its group), readable and writable by
// it alone.
func chownWritable(path string, uid uint32) error {
	if err := os.Chown(path, int(uid), int(uid)); err != nil {
		return err
	}
	return os.Chmod(path, 0o600)
}

// searchableUp adds search permission for others to dir and every
// directory above it that lacks it, once per directory, and logs each.
func (d *Driver) searchableUp(dir string) error {
	d.uidMu.Lock()
	defer d.uidMu.Unlock()
	for ; ; dir = filepath.Dir(dir) {
		if d.searchable[dir] {
			return nil
		}
		fi, err := os.Stat(dir)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o001 == 0 {
			mode := fi.Mode().Perm() | 0o001
			if err := os.Chmod(dir, mode); err != nil {
				return fmt.Errorf("let qemu's uids through %s: %w", dir, err)
			}
			d.log.Info("directory made searchable by others: qemu runs as a uid of its vm and reaches its files through it",
				"dir", dir, "mode", fmt.Sprintf("%#o", mode))
		}
		d.searchable[dir] = true
		if parent := filepath.Dir(dir); parent == dir {
			return nil
		}
	}
}

// freezeDisk makes a disk a snapshot holds read-only and the agent's: its
// VM's QEMU, which owned it, can no longer chmod it back and write it
// under the snapshot's other users.
func freezeDisk(path string, asRoot bool) error {
	if asRoot {
		if err := os.Chown(path, 0, 0); err != nil {
			return err
		}
	}
	return os.Chmod(path, 0o444)
}
