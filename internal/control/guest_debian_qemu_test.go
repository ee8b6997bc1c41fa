package control_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var (
	// getty's prompt starts a line; the kernel or cloud-init may print on
	// after it on the same line.
	loginPrompt     = regexp.MustCompile(`(?m)^\r?\S+ login: `)
	cloudInitStarts = regexp.MustCompile(`Cloud-init v\. \S+ running`)
)

// A real Debian 12 guest (make image-debian) configured through the control
// API: an SSH key generated here and user data that writes a file. The test
// waits for GET /v1/vms/{id}/guest to say cloud-init is done, then logs in
// over SSH through the user-mode forward on 127.0.0.1 with that key and
// reads the file. It logs how long the guest took to its login prompt and
// to cloud-init's end (TCG: minutes).
func TestQEMUDebianGuestCloudInitAndSSH(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a real Debian guest")
	}
	src := debianImageDir()
	if src == "" && os.Getenv("KVM_REQUIRE_DEBIAN") == "1" {
		t.Fatal("no debian-12 image, and KVM_REQUIRE_DEBIAN=1: `make test` builds it as root with mmdebstrap (make image-debian)")
	}
	if src == "" {
		t.Skip("no debian-12 image: build it with `make image-debian` (IMAGE_DIR=.cache/images, or set KVM_DEBIAN_IMAGE_DIR to the folder holding debian-12)")
	}
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	sshPub, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir()})
	c.RegisterHost(t, "h1", a.Address)
	served := t.TempDir()
	sha := testenv.BundleImage(t, src, filepath.Join(served, "debian-12.tar"))
	srv := testenv.StartImageServer(t, served)
	ctx := context.Background()
	if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "debian-12", SourceURL: srv.FileURL("debian-12.tar"),
		SHA256: sha, Format: api.ImageFormatKernel, MinDiskMiB: 2048, Prefetch: true}); err != nil {
		t.Fatal(err)
	}
	waitImageReady(t, c, "debian-12")
	secret := fmt.Sprintf("written by cloud-init for %s", t.Name())
	userData := "#cloud-config\nwrite_files:\n- path: /etc/kvm-test.txt\n  permissions: '0644'\n  content: " + secret + "\n"
	start := time.Now()
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "debian-ssh", Image: "debian-12", VCPUs: 2, MemoryMiB: 1024, DiskMiB: 4096,
		UserData: userData, SSHAuthorizedKeys: []string{strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub))) + " test"},
		NetworkInterfaces: []api.NetworkInterface{{Network: api.DefaultNetwork, PortForwards: []api.PortForward{{GuestPort: 22}}}}}, "")
	if err != nil {
		t.Fatal(err)
	}
	created := time.Since(start)
	if vm.StartedFrom != api.StartedCold || len(vm.NetworkInterfaces) != 1 || len(vm.NetworkInterfaces[0].PortForwards) != 1 {
		t.Fatalf("created: %+v", vm)
	}
	fwd := vm.NetworkInterfaces[0].PortForwards[0]
	// Poll the control API (console and guest status) until cloud-init is
	// done, noting when the guest reached its milestones.
	var ciStart, login, done time.Duration
	deadline := time.Now().Add(10 * time.Minute)
	for done == 0 {
		con, err := c.Client.VMConsole(ctx, vm.ID, 256<<10)
		if err == nil && ciStart == 0 && cloudInitStarts.MatchString(con) {
			ciStart = time.Since(start)
		}
		if err == nil && login == 0 && loginPrompt.MatchString(con) {
			login = time.Since(start)
		}
		g, gerr := c.Client.VMGuest(ctx, vm.ID)
		switch {
		case gerr == nil && g.CloudInit == api.CloudInitDone:
			done = time.Since(start)
		case gerr == nil && g.CloudInit == api.CloudInitError:
			t.Fatalf("cloud-init failed in the guest; console:\n%s", con)
		case time.Now().After(deadline):
			t.Fatalf("cloud-init not done within 10 minutes (guest %+v, %v); console:\n%s", g, gerr, con)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("debian guest under %s: create answered %.1fs, cloud-init started %.1fs, login prompt %.1fs, cloud-init done %.1fs (after the create call began)",
		hostAccel(t, c), created.Seconds(), ciStart.Seconds(), login.Seconds(), done.Seconds())

	cfg := &ssh.ClientConfig{User: "debian", Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)},
		// The guest's host keys were made by cloud-init at this boot; the
		// test trusts the forward on 127.0.0.1 that it just made.
		HostKeyCallback: ssh.InsecureIgnoreHostKey(), Timeout: 10 * time.Second}
	addr := net.JoinHostPort(fwd.HostAddress, fmt.Sprint(fwd.HostPort))
	var cl *ssh.Client
	for i := 0; ; i++ {
		if cl, err = ssh.Dial("tcp", addr, cfg); err == nil {
			break
		}
		if i == 30 {
			t.Fatalf("ssh debian@%s with the applied key: %v", addr, err)
		}
		time.Sleep(2 * time.Second)
	}
	defer func() { _ = cl.Close() }()
	sess, err := cl.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sess.Close() }()
	out, err := sess.CombinedOutput("cat /etc/kvm-test.txt; echo; hostname")
	if err != nil {
		t.Fatalf("ssh command: %v: %s", err, out)
	}
	if want := secret + "\n" + vm.Hostname + "\n"; string(out) != want {
		t.Fatalf("ssh command printed %q, want %q", out, want)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
}

// waitImageReady waits until a registered image is ready on a host.
func waitImageReady(t *testing.T, c *testenv.Control, name string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Minute)
	for {
		img, err := c.Client.GetImage(context.Background(), name)
		if err == nil && len(img.Hosts) > 0 && img.Hosts[0].Status == api.ImageReady {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("image %s not ready: %+v %v", name, img, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// hostAccel is the accelerator of the test's one host (kvm or tcg).
func hostAccel(t *testing.T, c *testenv.Control) string {
	t.Helper()
	hosts, err := c.Client.AllHosts(context.Background())
	if err != nil || len(hosts) == 0 {
		return "unknown"
	}
	return hosts[0].Accel
}
