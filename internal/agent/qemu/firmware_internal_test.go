package qemu

import (
	"bytes"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// fakeOVMF is a firmware folder with the four files the driver names, each
// holding its own name, so a copy shows which template it came from.
func fakeOVMF(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, f := range []string{ovmfCode, ovmfVars, ovmfSecureCode, ovmfSecureVars} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// argsOf are the values after each occurrence of flag.
func argsOf(args []string, flag string) []string {
	var out []string
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag {
			out = append(out, args[i+1])
		}
	}
	return out
}

// QEMU's command line of each firmware: bios has no flash; uefi maps
// OVMF's code read-only from the firmware folder and the VM's own
// variables from its directory on q35's two flash chips; Secure Boot
// takes the secboot code, SMM and a secure flash.
func TestFirmwareArgs(t *testing.T) {
	ovmf := fakeOVMF(t)
	d := &Driver{opts: Options{OVMFDir: ovmf}, accel: "tcg", log: slog.Default()}
	vmDir := filepath.Join(t.TempDir(), "vms", "uefi-1")
	img := &image{manifest: manifest{Kind: agent.ImageDisk, Disk: "disk.qcow2", Machine: "q35", Firmware: "uefi"}, dir: t.TempDir()}
	base := agent.Machine{ID: "uefi-1", Dir: vmDir, Image: "debian-uefi", VCPUs: 1, MemoryMiB: 512, DiskMiB: 4096}

	for _, c := range []struct {
		name      string
		firmware  string
		secure    bool
		imgFW     string
		machine   string
		code      string
		wantFlash bool
	}{
		{"bios", "bios", false, "bios", "q35,memory-backend=ram", "", false},
		{"uefi", "uefi", false, "bios", "q35,memory-backend=ram,pflash0=fw-code,pflash1=fw-vars", ovmfCode, true},
		{"uefi from the image", "", false, "uefi", "q35,memory-backend=ram,pflash0=fw-code,pflash1=fw-vars", ovmfCode, true},
		{"secure boot", "uefi", true, "uefi", "q35,memory-backend=ram,pflash0=fw-code,pflash1=fw-vars,smm=on", ovmfSecureCode, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := base
			m.Firmware, m.SecureBoot = c.firmware, c.secure
			im := *img
			im.Firmware = c.imgFW
			args := d.args(&m, &im, agent.BootOptions{}, childFiles{}, nil, 0)
			if got := argsOf(args, "-machine"); len(got) != 1 || got[0] != c.machine {
				t.Fatalf("-machine %v, want %q", got, c.machine)
			}
			blockdevs := argsOf(args, "-blockdev")
			if !c.wantFlash {
				if len(blockdevs) != 0 || slices.Contains(args, "-global") {
					t.Fatalf("bios vm has flash options: %v", args)
				}
				return
			}
			want := []string{
				"driver=raw,node-name=fw-code,read-only=on,file.driver=file,file.filename=" + filepath.Join(ovmf, c.code),
				"driver=raw,node-name=fw-vars,file.driver=file,file.filename=" + filepath.Join(vmDir, agent.VarsFileName),
			}
			if !slices.Equal(blockdevs, want) {
				t.Fatalf("-blockdev %q\nwant %q", blockdevs, want)
			}
			globals := argsOf(args, "-global")
			if c.secure != slices.Contains(globals, "driver=cfi.pflash01,property=secure,value=on") {
				t.Fatalf("secure boot %v, -global %v", c.secure, globals)
			}
		})
	}
}

// A comma in the state directory stays inside the vars file's path.
func TestFirmwareArgsQuoteTheVarsPath(t *testing.T) {
	d := &Driver{opts: Options{OVMFDir: "/usr/share/OVMF"}, accel: "tcg", log: slog.Default()}
	m := &agent.Machine{ID: "v", Dir: "/state,x/vms/v", Firmware: "uefi"}
	_, args := d.firmwareArgs(m, &image{manifest: manifest{Kind: agent.ImageDisk}})
	if !strings.HasSuffix(args[3], "file.filename=/state,,x/vms/v/efivars.fd") {
		t.Fatalf("vars blockdev %q: want the comma doubled", args[3])
	}
}

// Create gives a uefi VM its own copy of the variables template (the
// Microsoft-keyed one with Secure Boot) beside its disk, once: a second
// Create keeps the variables the guest wrote. A bios VM gets none.
func TestCreateCopiesTheVarsTemplate(t *testing.T) {
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("qemu-img is not installed")
	}
	imageDir := t.TempDir()
	imgDir := filepath.Join(imageDir, "blank-uefi")
	if err := os.MkdirAll(imgDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(imgDir, "disk.raw"), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(imgDir, "image.json"),
		[]byte(`{"kind": "disk", "disk": "disk.raw", "disk_format": "raw", "firmware": "uefi"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	d := &Driver{opts: Options{OVMFDir: fakeOVMF(t), ImageDir: imageDir}, qemuImg: qemuImg, accel: "tcg", log: slog.Default()}
	for _, c := range []struct {
		id       string
		firmware string
		secure   bool
		want     string
	}{
		{"plain", "", false, ovmfVars},
		{"secure", agentapi.FirmwareUEFI, true, ovmfSecureVars},
		{"bios", agentapi.FirmwareBIOS, false, ""},
	} {
		m := &agent.Machine{ID: c.id, Dir: filepath.Join(t.TempDir(), c.id), Image: "blank-uefi", VCPUs: 1, MemoryMiB: 128, DiskMiB: 8,
			Firmware: c.firmware, SecureBoot: c.secure}
		if err := os.MkdirAll(m.Dir, 0o750); err != nil {
			t.Fatal(err)
		}
		if err := d.Create(t.Context(), m); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(varsPath(m))
		if c.want == "" {
			if err == nil {
				t.Fatalf("vm %s (bios) has uefi variables", c.id)
			}
			continue
		}
		if err != nil || string(got) != c.want {
			t.Fatalf("vm %s: variables %q, %v; want a copy of %s", c.id, got, err, c.want)
		}
		if err := os.WriteFile(varsPath(m), []byte("written by the guest"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := d.Create(t.Context(), m); err != nil {
			t.Fatal(err)
		}
		if got, _ := os.ReadFile(varsPath(m)); !bytes.Equal(got, []byte("written by the guest")) {
			t.Fatalf("vm %s: a second Create replaced the guest's variables with %q", c.id, got)
		}
	}
}

// CheckSpec reads the image's disk: a UEFI-only disk (a GPT with an EFI
// system partition, no boot code in its protective MBR) is refused under
// bios with the registered name and what to set, accepted under uefi; a
// uefi VM on a host without OVMF is refused naming the package.
func TestCheckSpecRefusesAUEFIOnlyDiskUnderBIOS(t *testing.T) {
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("qemu-img is not installed")
	}
	disk := make([]byte, 1<<20)
	disk[446+4], disk[510], disk[511] = 0xee, 0x55, 0xaa // protective MBR, no code
	copy(disk[512:], "EFI PART")
	disk[512+72], disk[512+80], disk[512+84] = 2, 128, 128 // entries at LBA 2: 128 of 128 bytes
	copy(disk[1024:], []byte{0x28, 0x73, 0x2a, 0xc1, 0x1f, 0xf8, 0xd2, 0x11, 0xba, 0x4b, 0x00, 0xa0, 0xc9, 0x3e, 0xc9, 0x3b})
	imageDir := t.TempDir()
	folder := filepath.Join(imageDir, "gpt")
	if err := os.MkdirAll(folder, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(folder, "disk.raw"), disk, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(folder, "image.json"), []byte(`{"kind": "disk", "disk": "disk.raw", "disk_format": "raw"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	d := &Driver{opts: Options{OVMFDir: fakeOVMF(t), ImageDir: imageDir}, qemuImg: qemuImg, accel: "tcg", log: slog.Default()}
	img := agent.Image{Name: "gpt", Kind: agent.ImageDisk}
	spec := agentapi.VMSpec{Image: "gpt", VCPUs: 1, MemoryMiB: 128, DiskMiB: 8,
		ImageSource: &agentapi.ImageSource{Name: "debian-uefi"}}
	err = d.CheckSpec(spec, img)
	if err == nil || !strings.Contains(err.Error(), "image debian-uefi is UEFI-only") || !strings.Contains(err.Error(), `set firmware = "uefi"`) {
		t.Fatalf("bios: %v; want the UEFI-only refusal naming debian-uefi", err)
	}
	spec.Firmware = agentapi.FirmwareUEFI
	if err := d.CheckSpec(spec, img); err != nil {
		t.Fatalf("uefi: %v", err)
	}
	d.opts.OVMFDir = t.TempDir()
	if err := d.CheckSpec(spec, img); err == nil || !strings.Contains(err.Error(), "apt-get install ovmf") {
		t.Fatalf("uefi without OVMF: %v; want a refusal naming the ovmf package", err)
	}
}
