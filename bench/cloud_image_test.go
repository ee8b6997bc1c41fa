package bench

// Create to SSH of the three Debian 12 guest shapes (issue 30):
//
//	KVM_IMAGE_DIR=<folder holding debian-12 and debian-12-cloud-*> \
//	  go test ./bench -run '^$' -bench CloudImageToSSH -benchtime 1x -timeout 60m
//
// after make image-debian image-debian-cloud. One control API and one QEMU
// agent; the three images are registered and prefetched first, so no
// fetch is timed:
//   - kernel: the debian-12 kernel bundle (QEMU loads its kernel and
//     initrd, root=/dev/vda, no firmware boot),
//   - bios: debian-12-cloud-bios (SeaBIOS, syslinux from the MBR and a FAT
//     boot partition, root on partition 2),
//   - uefi: debian-12-cloud-uefi (OVMF, GRUB from the EFI system
//     partition, root on partition 2).
//
// Each VM: 2 vCPUs, 1024 MiB, a 4096 MiB disk (the cloud images grow their
// root partition to it), an SSH key and a forward of port 22. The time is
// from the start of POST /v1/vms to the first SSH command that runs with
// that key (cloud-init has written it by then). The three shapes take
// turns, one VM at a time, three rounds: p50 of 3 each, side by side.
//
// Numbers are reported, never asserted.

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// cloudShapes are the images of BenchmarkCloudImageToSSH: the folder under
// KVM_IMAGE_DIR, its registered format and firmware.
var cloudShapes = []struct{ name, folder, format, firmware string }{
	{"kernel", "debian-12", api.ImageFormatKernel, ""},
	{"bios", "debian-12-cloud-bios", api.ImageFormatQCOW2, api.FirmwareBIOS},
	{"uefi", "debian-12-cloud-uefi", api.ImageFormatQCOW2, api.FirmwareUEFI},
}

func BenchmarkCloudImageToSSH(b *testing.B) {
	defer machineState(b)()
	dir := os.Getenv("KVM_IMAGE_DIR")
	for _, s := range cloudShapes {
		if _, err := os.Stat(filepath.Join(dir, s.folder, "image.json")); err != nil {
			b.Skipf("no %s in KVM_IMAGE_DIR=%q: make image-debian image-debian-cloud", s.folder, dir)
		}
	}
	testenv.RequireQEMU(b)
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		b.Fatal(err)
	}
	sshPub, err := ssh.NewPublicKey(pub)
	if err != nil {
		b.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		b.Fatal(err)
	}
	authorized := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub)))
	served := b.TempDir()
	shas := map[string]string{}
	for _, s := range cloudShapes {
		file := s.name + ".img"
		if s.format == api.ImageFormatKernel {
			shas[s.name] = testenv.BundleImage(b, filepath.Join(dir, s.folder), filepath.Join(served, file))
			continue
		}
		if err := os.Symlink(filepath.Join(dir, s.folder, "disk.qcow2"), filepath.Join(served, file)); err != nil {
			b.Fatal(err)
		}
		shas[s.name] = testenv.FileSHA256(b, filepath.Join(served, file))
	}
	srv := testenv.StartImageServer(b, served)
	const rounds = 3
	for b.Loop() {
		c := testenv.StartControl(b, testenv.ControlOptions{})
		a := testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu", ImageDir: b.TempDir()})
		c.RegisterHost(b, "h1", a.Address)
		ctx := context.Background()
		for _, s := range cloudShapes {
			if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: s.name, SourceURL: srv.FileURL(s.name + ".img"),
				SHA256: shas[s.name], Format: s.format, Firmware: s.firmware, Prefetch: true}); err != nil {
				b.Fatal(err)
			}
		}
		waitImagesReady(b, c)
		times := map[string][]time.Duration{}
		for r := range rounds {
			for _, s := range cloudShapes {
				d := createToSSH(b, c, fmt.Sprintf("%s-%d", s.name, r), s.name, authorized, signer)
				b.Logf("round %d: %s guest: create to ssh %.1f s", r+1, s.name, d.Seconds())
				times[s.name] = append(times[s.name], d)
			}
		}
		for _, s := range cloudShapes {
			b.ReportMetric(p50(times[s.name])/1000, s.name+"-p50-s")
		}
	}
}

// waitImagesReady waits until every registered image is ready on the host.
func waitImagesReady(b *testing.B, c *testenv.Control) {
	deadline := time.Now().Add(10 * time.Minute)
	for _, s := range cloudShapes {
		for {
			img, err := c.Client.GetImage(context.Background(), s.name)
			if err == nil && len(img.Hosts) == 1 && img.Hosts[0].Status == api.ImageReady {
				break
			}
			if err == nil && len(img.Hosts) == 1 && img.Hosts[0].Status == api.ImageFailed {
				b.Fatalf("image %s failed: %s", s.name, img.Hosts[0].Reason)
			}
			if time.Now().After(deadline) {
				b.Fatalf("image %s not ready: %+v %v", s.name, img, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// createToSSH creates a VM of image and returns the time until an SSH
// command runs in it with the key; the VM is deleted after.
func createToSSH(b *testing.B, c *testenv.Control, name, image, authorized string, signer ssh.Signer) time.Duration {
	ctx := context.Background()
	start := time.Now()
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: image, VCPUs: 2, MemoryMiB: 1024, DiskMiB: 4096,
		SSHAuthorizedKeys: []string{authorized},
		NetworkInterfaces: []api.NetworkInterface{{Network: api.DefaultNetwork, PortForwards: []api.PortForward{{GuestPort: 22}}}}}, "")
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
			b.Fatal(err)
		}
	}()
	fwd := vm.NetworkInterfaces[0].PortForwards[0]
	addr := net.JoinHostPort(fwd.HostAddress, strconv.Itoa(fwd.HostPort))
	cfg := &ssh.ClientConfig{User: "debian", Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: ssh.InsecureIgnoreHostKey(), Timeout: 10 * time.Second}
	deadline := time.Now().Add(15 * time.Minute)
	for {
		if err := sshTrue(addr, cfg); err == nil {
			return time.Since(start)
		} else if time.Now().After(deadline) {
			con, _ := c.Client.VMConsole(ctx, vm.ID, 16<<10)
			b.Fatalf("vm %s (%s): no ssh within 15 minutes: %v; console:\n%s", vm.ID, image, err, con)
		}
		time.Sleep(time.Second)
	}
}

// sshTrue logs in and runs true.
func sshTrue(addr string, cfg *ssh.ClientConfig) error {
	cl, err := ssh.Dial("tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = cl.Close() }()
	sess, err := cl.NewSession()
	if err != nil {
		return err
	}
	defer func() { _ = sess.Close() }()
	return sess.Run("true")
}
