package qemu

// UEFI guests: OVMF from Debian's ovmf package (its README.Debian says
// which file is which).
//
//	OVMF_CODE_4M.fd          the firmware without Secure Boot, read-only
//	OVMF_VARS_4M.fd          its empty variable store template
//	OVMF_CODE_4M.secboot.fd  the firmware that enforces Secure Boot; it
//	                         stops unless QEMU emulates SMM (q35 smm=on,
//	                         and the flash secure: only SMM code may write
//	                         the variables)
//	OVMF_VARS_4M.ms.fd       variables with the Microsoft keys in KEK and
//	                         DB, Secure Boot already on
//
// The code is mapped read-only from /usr/share/OVMF (a system file, like
// QEMU's own ROMs). The variables are the VM's own: a copy of the template
// in its directory (agent.VarsFileName), made at its first boot, owned by
// its QEMU's uid like its disk, carried by warm VMs' handovers and by
// snapshots to their children. Every path on the command line is the
// driver's: the firmware's fixed names under Options.OVMFDir, and the
// VM's directory.

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	imagecache "github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// DefaultOVMFDir is where Debian's ovmf package installs OVMF.
const DefaultOVMFDir = "/usr/share/OVMF"

// OVMF files (4 MB flash: 2 MB is too small for Secure Boot's variables).
const (
	ovmfCode       = "OVMF_CODE_4M.fd"
	ovmfVars       = "OVMF_VARS_4M.fd"
	ovmfSecureCode = "OVMF_CODE_4M.secboot.fd"
	ovmfSecureVars = "OVMF_VARS_4M.ms.fd"
)

// Block node names of the two flash chips.
const (
	fwCodeNode = "fw-code"
	fwVarsNode = "fw-vars"
)

// ovmf is the firmware files of a VM: its code and the template of its
// variables.
func (d *Driver) ovmf(secureBoot bool) (code, vars string) {
	if secureBoot {
		return filepath.Join(d.opts.OVMFDir, ovmfSecureCode), filepath.Join(d.opts.OVMFDir, ovmfSecureVars)
	}
	return filepath.Join(d.opts.OVMFDir, ovmfCode), filepath.Join(d.opts.OVMFDir, ovmfVars)
}

// checkOVMF says, for a uefi VM, which firmware file this host lacks.
func (d *Driver) checkOVMF(secureBoot bool) error {
	code, vars := d.ovmf(secureBoot)
	for _, f := range []string{code, vars} {
		if _, err := os.Stat(f); err != nil {
			return agent.ErrInvalidSpec("this host cannot boot uefi vms: %v; install the ovmf package (apt-get install ovmf) or give --ovmf-dir", err)
		}
	}
	return nil
}

// firmwareOf is the firmware VM m boots with: its own, else its image's.
func firmwareOf(m *agent.Machine, img *image) string {
	if m.Firmware != "" {
		return m.Firmware
	}
	return img.EffectiveFirmware()
}

// varsPath is the UEFI variable store of m.
func varsPath(m *agent.Machine) string { return filepath.Join(m.Dir, agent.VarsFileName) }

// firmwareArgs are the machine options and block nodes of m's firmware:
// nothing for bios (QEMU's SeaBIOS), OVMF's two flash chips for uefi,
// with SMM and a secure flash for Secure Boot.
func (d *Driver) firmwareArgs(m *agent.Machine, img *image) (machineOpts string, args []string) {
	if firmwareOf(m, img) != agentapi.FirmwareUEFI {
		return "", nil
	}
	code, _ := d.ovmf(m.SecureBoot)
	machineOpts = ",pflash0=" + fwCodeNode + ",pflash1=" + fwVarsNode
	args = []string{
		"-blockdev", "driver=raw,node-name=" + fwCodeNode + ",read-only=on,file.driver=file,file.filename=" + qemuOptQuote(code),
		"-blockdev", "driver=raw,node-name=" + fwVarsNode + ",file.driver=file,file.filename=" + qemuOptQuote(varsPath(m)),
	}
	if m.SecureBoot {
		machineOpts += ",smm=on"
		args = append(args, "-global", "driver=cfi.pflash01,property=secure,value=on")
	}
	return machineOpts, args
}

// ensureVars gives a uefi VM its variable store: a copy of from (the
// firmware's template, or a snapshot's variables for a child) unless it
// has one. It is written to a temporary name and renamed into place.
func ensureVars(m *agent.Machine, from string) error {
	dst := varsPath(m)
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	if err := copyFile(from, dst); err != nil {
		return fmt.Errorf("uefi variables of vm %s: %w", m.ID, err)
	}
	return nil
}

// copyFile copies src to dst (mode 0600) through dst.tmp.
func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	tmp := dst + ".tmp"
	out, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	if serr := out.Sync(); err == nil {
		err = serr
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, dst)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

// checkBootFirmware refuses a disk image whose first sectors say that the
// VM's firmware cannot boot it (a UEFI-only disk under SeaBIOS waits
// forever at "not a bootable disk"), and a uefi VM on a host without OVMF.
func (d *Driver) checkBootFirmware(spec agentapi.VMSpec, img *image) error {
	fw := spec.Firmware
	if fw == "" {
		fw = img.EffectiveFirmware()
	}
	if spec.Snapshot != nil {
		return nil // a child continues its source's running guest
	}
	if fw == agentapi.FirmwareUEFI {
		if err := d.checkOVMF(spec.SecureBoot); err != nil {
			return err
		}
	}
	if img.Kind != agent.ImageDisk || img.Disk == "" {
		return nil
	}
	shape, err := imagecache.DiskBootShape(d.path(img, img.Disk), img.EffectiveDiskFormat())
	if err != nil {
		// A disk the reader does not follow (zstd, a backing file) is
		// booted as asked.
		d.log.Debug("boot sectors of an image not read", "image", img.Name, "err", err)
		return nil
	}
	if why := imagecache.FirmwareMismatch(agent.ImageName(spec), fw, shape); why != "" {
		return agent.ErrInvalidSpec("%s", why)
	}
	return nil
}
