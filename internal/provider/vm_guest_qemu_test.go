package provider_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// qemuFleet is a control API with one real QEMU agent (TCG) as host q1.
func qemuFleet(t *testing.T, opts testenv.AgentOptions) (*fleet, *testenv.Agent) {
	t.Helper()
	accPreCheck(t)
	opts.Driver = "qemu"
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	a := testenv.StartAgent(t, opts)
	f.Control.RegisterHost(t, "q1", a.Address)
	f.Agents["q1"] = a
	return f, a
}

// busyboxGuestConfig is a busybox kvm_vm with guest configuration that
// waits for cloud_init, and the console data source beside it.
func busyboxGuestConfig(f *fleet, userData, waitFor, createTimeout string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "test" {
  name       = "bb-guest"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
  user_data  = %q
  meta_data = {
    "local-hostname" = "bb-1"
  }
  wait_for = %q

  timeouts {
    create = %q
  }
}

data "kvm_vm_console" "test" {
  vm_id = kvm_vm.test.id
}
`, userData, waitFor, createTimeout)
}

// checkGuestReported checks what the guest itself reported (GET
// /v1/vms/{id}/guest): cloud-init done, and the hostname and user-data
// digest it read from its seed equal to what Terraform applied; the
// kvm_vm_console data source shows the guest's digest line.
func checkGuestReported(f *fleet, id *string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		attrs := s.RootModule().Resources[vmAddr].Primary.Attributes
		g, err := f.Control.Client.VMGuest(context.Background(), *id)
		if err != nil {
			return fmt.Errorf("GET /v1/vms/%s/guest: %w", *id, err)
		}
		if g.CloudInit != api.CloudInitDone || g.Hostname != attrs["hostname"] || g.UserDataSHA256 != attrs["user_data_sha256"] ||
			attrs["hostname"] != "bb-1" {
			return fmt.Errorf("the guest reported %+v; Terraform applied hostname %q and user data %s",
				g, attrs["hostname"], attrs["user_data_sha256"])
		}
		console := s.RootModule().Resources["data.kvm_vm_console.test"].Primary.Attributes["output"]
		if line := "kvm-guest-userdata-sha256 " + attrs["user_data_sha256"]; !strings.Contains(console, line) {
			return fmt.Errorf("kvm_vm_console shows no %q; it ends with:\n%s", line, tail(console, 1500))
		}
		return nil
	}
}

// TestAccVM_guestCloudInitBusybox: a busybox guest with user data and a
// hostname; wait_for = "cloud_init" returns once the guest finished reading
// its seed, and what it reports equals what was applied. A change of user
// data is a replace, and the new guest reports the new digest; a change of
// wait_for to "ip" is an update in place that waits for the guest's address.
func TestAccVM_guestCloudInitBusybox(t *testing.T) {
	f, _ := qemuFleet(t, testenv.AgentOptions{})
	var id1, id2 string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: busyboxGuestConfig(f, "#cloud-config\nruncmd: [echo one]\n", "cloud_init", "5m"),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("hostname"), knownvalue.StringExact("bb-1")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data_sha256"),
						knownvalue.StringExact(sha256Hex("#cloud-config\nruncmd: [echo one]\n"))),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("started_from"), knownvalue.StringExact("cold")),
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id1), checkGuestReported(f, &id1)),
			},
			{
				Config: busyboxGuestConfig(f, "#cloud-config\nruncmd: [echo two]\n", "cloud_init", "5m"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace)},
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id2), checkGuestReported(f, &id2),
					func(*terraform.State) error {
						if id1 == id2 {
							return fmt.Errorf("VM %s was not replaced", id1)
						}
						return nil
					}),
			},
			{
				// wait_for changes in place, and an update waits for it:
				// the guest reported its address on the user-mode network.
				Config: busyboxGuestConfig(f, "#cloud-config\nruncmd: [echo two]\n", "ip", "5m"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("wait_for"), knownvalue.StringExact("ip")),
				},
				Check: func(*terraform.State) error {
					g, err := f.Control.Client.VMGuest(context.Background(), id2)
					if err != nil || len(g.IPv4Addresses) == 0 || g.IPv4Addresses[0] != "10.0.2.15" {
						return fmt.Errorf("VM %s: the guest reports addresses %v (%v), want QEMU's user-mode 10.0.2.15", id2, g.IPv4Addresses, err)
					}
					return nil
				},
			},
		},
	})
}

// TestAccVM_guestNeverFinishes: user data that blocks (a #! script that
// sleeps, which the busybox guest runs before it reports cloud-init
// finished, as cloud-init does) makes wait_for = "cloud_init" time out: the
// apply fails with the console's last lines in the error (the script's own
// output among them), the VM is in state as tainted and is the only VM there
// is, the next apply replaces it, and destroy leaves nothing. (Real
// cloud-init's own stages are read from a Debian guest's console in
// TestAccVM_guestCloudInitModuleFailsDebian and, line by line from both
// cloud-init versions, in the agent's guest status tests; a Debian guest that
// never finishes added minutes of CI and nothing this test does not show.)
//
// The create timeout that must end with cloud-init running and the script
// started is measured, not fixed (guestStageTimeout): a TCG guest on a
// loaded machine takes minutes to get there.
func TestAccVM_guestNeverFinishes(t *testing.T) {
	f, _ := qemuFleet(t, testenv.AgentOptions{})
	const script = "#!/bin/sh\necho kvm-test-user-script-started\nsleep 100000\n"
	timeout := guestStageTimeout(t, f, script, "kvm-test-user-script-started")
	// The busybox guest prints a "tick N" line every second: they are the
	// console's end, so the tail in the error is made of them; the script's
	// own line is checked on the whole console.
	testNeverFinishes(t, f, func(waitFor string) string {
		return busyboxGuestConfig(f, script, waitFor, timeout)
	}, `tick [0-9]+\s+tick [0-9]+`, func(console string) error {
		if !strings.Contains(console, "kvm-test-user-script-started") || strings.Contains(console, "finished at") {
			return fmt.Errorf("the console does not show the script running and cloud-init unfinished:\n%s", tail(console, 3000))
		}
		return nil
	})
}

// guestStageTimeout measures how long a busybox guest with userData takes
// here, now, to reach the stage a test's create timeout must find it in:
// cloud-init running and line on its console. It boots one through the
// control API, deletes it, and returns three times that plus a minute, as a
// Terraform duration: a loaded machine (other tests, a CPU hog) makes the
// timeout longer instead of the test fail, an idle one keeps it short.
func guestStageTimeout(t *testing.T, f *fleet, userData, line string) string {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	vm, err := f.Control.Client.CreateVM(ctx, api.VMCreate{Name: "bb-stage-measure", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64,
		UserData: userData}, "")
	if err != nil {
		t.Fatalf("create the guest that measures the boot: %v", err)
	}
	deadline := start.Add(15 * time.Minute)
	for {
		g, gerr := f.Control.Client.VMGuest(ctx, vm.ID)
		con, cerr := f.Control.Client.VMConsole(ctx, vm.ID, 0)
		if gerr == nil && cerr == nil && g.CloudInit == api.CloudInitRunning && strings.Contains(con, line) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("measuring the boot: vm %s did not reach cloud-init running with %q on its console within 15m (%+v, %v, %v); console:\n%s",
				vm.ID, line, g, gerr, cerr, tail(con, 3000))
		}
		time.Sleep(250 * time.Millisecond)
	}
	took := time.Since(start)
	if err := f.Control.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatalf("delete the guest that measured the boot: %v", err)
	}
	for {
		_, err := f.Control.Client.GetVM(ctx, vm.ID)
		if errors.Is(err, client.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the guest that measured the boot, %s, is not gone (%v)", vm.ID, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	timeout := 3*took + time.Minute
	t.Logf("a busybox guest reached cloud-init running with %q in %s: create timeout %s", line, took.Round(100*time.Millisecond), timeout.Round(time.Second))
	return fmt.Sprintf("%ds", int(timeout.Seconds()))
}

// testNeverFinishes applies cfg("cloud_init"), which must time out with the
// console tail (matching tailPattern) in the error and leave the VM tainted
// in state and alone on the control API, its whole console passing
// checkConsole; then cfg("running"), which must replace it.
func testNeverFinishes(t *testing.T, f *fleet, cfg func(waitFor string) string, tailPattern string, checkConsole func(string) error) {
	t.Helper()
	readStates := stateFiles(t)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: cfg("cloud_init"),
				ExpectError: regexp.MustCompile(`(?s)VM Guest Not Ready.*` + words(`cloud-init in the guest had not finished (its state: "running")`) +
					`.*timeouts\.create.*` + words(`Last 30 lines of its serial console:`) + `.*` + tailPattern),
			},
			{
				PreConfig: func() {
					status, id, err := vmInState(readStates)
					if err != nil || status != "tainted" || id == "" {
						t.Fatalf("after the failed wait the VM is in state as %q (id %q, %v), want tainted", status, id, err)
					}
					vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
					if err != nil || len(vms) != 1 || vms[0].ID != id {
						t.Fatalf("the control API holds %d VMs (%v), want only the tainted %s", len(vms), err, id)
					}
					console, err := f.Control.Client.VMConsole(context.Background(), id, 0)
					if err != nil {
						t.Fatalf("console of VM %s: %v", id, err)
					}
					if err := checkConsole(console); err != nil {
						t.Fatal(err)
					}
				},
				Config: cfg("running"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace)},
				},
			},
		},
	})
}

// words is a pattern matching the text with any white space between its
// words, as Terraform wraps a diagnostic's lines.
func words(text string) string {
	parts := strings.Fields(text)
	for i, p := range parts {
		parts[i] = regexp.QuoteMeta(p)
	}
	return strings.Join(parts, `\s+`)
}

// debianImageDir is an image directory holding debian-12 (make
// image-debian): $KVM_DEBIAN_IMAGE_DIR, $KVM_IMAGE_DIR or <repo>/.cache/images;
// "" when none does.
func debianImageDir() string {
	for _, d := range []string{os.Getenv("KVM_DEBIAN_IMAGE_DIR"), os.Getenv("KVM_IMAGE_DIR"), filepath.Join("..", "..", ".cache", "images")} {
		if d == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "debian-12", "image.json")); err == nil {
			return d
		}
	}
	return ""
}

// requireDebianImage returns the image directory holding debian-12, and
// skips the test without one (fails it with KVM_REQUIRE_DEBIAN=1). Every
// test that boots the Debian guest starts here, so this is also where
// KVM_SKIP_QEMU_GUEST=1 (set by make testacc-tofu) skips them all: their
// subject is the guest (cloud-init, SSH), which the CLI does not change, and
// each is minutes of a TCG guest; make test runs them under Terraform.
func requireDebianImage(t *testing.T) string {
	t.Helper()
	if os.Getenv("KVM_SKIP_QEMU_GUEST") == "1" {
		t.Skip("KVM_SKIP_QEMU_GUEST=1 (make testacc-tofu): this test boots the Debian guest, whose subject is the guest, " +
			"not the CLI; make test runs it under Terraform")
	}
	dir := debianImageDir()
	if dir == "" && os.Getenv("KVM_REQUIRE_DEBIAN") == "1" {
		t.Fatal("no debian-12 image, and KVM_REQUIRE_DEBIAN=1: build it with `make image-debian` (as root)")
	}
	if dir == "" {
		t.Skip("no debian-12 image: build it with `make image-debian` (or point KVM_DEBIAN_IMAGE_DIR at the folder holding debian-12)")
	}
	return dir
}

// TestAccVM_guestDebianSSH: a real Debian 12 cloud guest with an SSH key
// the test made: wait_for = "cloud_init" completes, then the test logs in
// as the image's default user through the user-mode forward on 127.0.0.1
// and runs a command whose output it checks; the guest status reports the
// hostname the guest printed on its console. It logs how long the apply
// took, and the guest's own uptime at cloud-init's start and end (from the
// console), which split it into boot and cloud-init.
func TestAccVM_guestDebianSSH(t *testing.T) {
	dir := requireDebianImage(t)
	f, _ := qemuFleet(t, testenv.AgentOptions{ImageDir: dir, VCPUs: 2, MemoryMiB: 2048, DiskMiB: 16384})
	signer, key := newSSHKey(t)
	cfg := f.providerBlock() + debianGuestConfig("deb-guest", "deb-1", `    #cloud-config
    write_files:
      - path: /etc/kvm-test
        content: "written by cloud-init\n"
`) + `
data "kvm_vm_console" "test" {
  vm_id = kvm_vm.test.id
  bytes = 1048576
}
`
	var start time.Time
	var addr, port string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{{
			PreConfig:       func() { start = time.Now() },
			Config:          cfg,
			ConfigVariables: config.Variables{"key": config.StringVariable(key)},
			Check: resource.ComposeTestCheckFunc(
				func(s *terraform.State) error {
					t.Logf("apply to cloud_init done: %s (wall clock, terraform apply included)", time.Since(start).Round(100*time.Millisecond))
					console := s.RootModule().Resources["data.kvm_vm_console.test"].Primary.Attributes["output"]
					t.Logf("guest uptime at cloud-init's stages: %s", cloudInitUptimes(console))
					return nil
				},
				// A cloud-init guest's hostname comes from its console (getty's
				// login prompt, or the SSH host keys cloud-init printed).
				func(s *terraform.State) error {
					id := s.RootModule().Resources[vmAddr].Primary.ID
					g, err := f.Control.Client.VMGuest(context.Background(), id)
					if err != nil || g.CloudInit != api.CloudInitDone || g.Hostname != "deb-1" || len(g.CloudInitErrors) != 0 {
						return fmt.Errorf("GET /v1/vms/%s/guest: %+v (%v), want done with hostname deb-1", id, g, err)
					}
					return nil
				},
				captureAttr(vmAddr, "network_interface.0.port_forward.0.host_address", &addr),
				captureAttr(vmAddr, "network_interface.0.port_forward.0.host_port", &port),
				func(*terraform.State) error {
					if addr != "127.0.0.1" {
						return fmt.Errorf("forward host_address %q, want 127.0.0.1", addr)
					}
					out, err := sshRun(net.JoinHostPort(addr, port), "debian", signer, "hostname; cat /etc/kvm-test; id -un")
					if err != nil {
						return err
					}
					if want := "deb-1\nwritten by cloud-init\ndebian\n"; out != want {
						return fmt.Errorf("the command over SSH printed %q, want %q", out, want)
					}
					t.Logf("ssh debian@%s:%s: %q", addr, port, out)
					return nil
				},
			),
		}},
	})
}

// sshRun logs in with the key and runs cmd, retrying the connection for a
// bounded while (sshd may restart once cloud-init has written host keys).
func sshRun(addr, user string, signer ssh.Signer, cmd string) (string, error) {
	cfg := &ssh.ClientConfig{
		User: user, Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)},
		// The guest's host key is new at every boot: a test guest on
		// 127.0.0.1 that the test itself made.
		HostKeyCallback: ssh.InsecureIgnoreHostKey(),
		Timeout:         20 * time.Second,
	}
	var last error
	for range 12 {
		c, err := ssh.Dial("tcp", addr, cfg)
		if err == nil {
			sess, serr := c.NewSession()
			if serr != nil {
				_ = c.Close()
				return "", serr
			}
			out, rerr := sess.Output(cmd)
			_ = c.Close()
			if rerr != nil {
				return string(out), fmt.Errorf("ssh %s@%s %q: %w", user, addr, cmd, rerr)
			}
			return string(out), nil
		}
		last = err
		time.Sleep(5 * time.Second)
	}
	return "", fmt.Errorf("ssh %s@%s: %w", user, addr, last)
}

var cloudInitStage = regexp.MustCompile(`Cloud-init v\. \S+ (running '([a-z-]+)'|finished) at .*?Up ([0-9.]+) seconds`)

// cloudInitUptimes lists the guest's uptime at each cloud-init stage it
// printed on the console ("init-local 12.3s, ..., finished 80.1s").
func cloudInitUptimes(console string) string {
	var parts []string
	for _, m := range cloudInitStage.FindAllStringSubmatch(console, -1) {
		stage := m[2]
		if stage == "" {
			stage = "finished"
		}
		parts = append(parts, stage+" "+m[3]+"s")
	}
	if len(parts) == 0 {
		return "(no cloud-init stage lines on the console)"
	}
	return strings.Join(parts, ", ")
}

// TestAccVM_guestCloudInitModuleFailsDebian: a real Debian 12 guest
// (cloud-init 22.4) whose user data makes a config module fail: write_files
// with an owner that does not exist, which cc_write_files turns into an
// OSError from util.chownbyname ("Unknown user or group") after writing the
// file, so the module fails in the init stage and cloud-init goes on to its
// "finished" line. wait_for = "cloud_init" fails with the module's console
// line and the console tail in the error; the guest status stays error once
// the final line is there too, as `cloud-init status` in the guest (over
// SSH) says, and reports the hostname from getty's login prompt; the VM is
// tainted in state and destroy removes it.
func TestAccVM_guestCloudInitModuleFailsDebian(t *testing.T) {
	dir := requireDebianImage(t)
	f, _ := qemuFleet(t, testenv.AgentOptions{ImageDir: dir, VCPUs: 2, MemoryMiB: 2048, DiskMiB: 16384})
	readStates := stateFiles(t)
	signer, key := newSSHKey(t)
	cfg := f.providerBlock() + debianGuestConfig("deb-module-fails", "deb-fails", `    #cloud-config
    write_files:
      - path: /etc/kvm-test-owned
        content: "owned by a user that does not exist\n"
        owner: kvm-no-such-user:kvm-no-such-user
`) + ``
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:          cfg,
				ConfigVariables: config.Variables{"key": config.StringVariable(key)},
				ExpectError: regexp.MustCompile(`(?s)VM Guest Not Ready.*` + words(`cloud-init in the guest reported an error (its console:`) +
					`.*util\.py\[WARNING\]:\s+` + words(`Running module write-files`) + `.*failed.*` +
					words(`Last 30 lines of its serial console:`) + `.*cloud-init\[\d+\]:`),
			},
			{
				PreConfig: func() {
					status, id, err := vmInState(readStates)
					if err != nil || status != "tainted" || id == "" {
						t.Fatalf("after the failed wait the VM is in state as %q (id %q, %v), want tainted", status, id, err)
					}
					g, console := guestAfterFinish(t, f, id)
					if g.CloudInit != api.CloudInitError || len(g.CloudInitErrors) == 0 ||
						!strings.Contains(g.CloudInitErrors[0], "Running module write-files") || g.Hostname != "deb-fails" {
						t.Fatalf("VM %s: after cloud-init's final line the guest status is %+v, want error naming write_files "+
							"and hostname deb-fails; the console ends with:\n%s", id, g, tail(console, 4000))
					}
					t.Logf("VM %s: guest status %q, hostname %q, failure lines:\n%s", id, g.CloudInit, g.Hostname,
						strings.Join(g.CloudInitErrors, "\n"))
					// The guest's own word: `cloud-init status` exits 1 on error.
					vm, err := f.Control.Client.GetVM(context.Background(), id)
					if err != nil || len(vm.NetworkInterfaces) != 1 || len(vm.NetworkInterfaces[0].PortForwards) != 1 {
						t.Fatalf("VM %s: %+v (%v), want one NIC with the SSH forward", id, vm, err)
					}
					fwd := vm.NetworkInterfaces[0].PortForwards[0]
					out, err := sshRun(net.JoinHostPort(fwd.HostAddress, fmt.Sprint(fwd.HostPort)), "debian", signer,
						"cloud-init status --wait --long")
					if !strings.Contains(out, "status: error") {
						t.Fatalf("VM %s: `cloud-init status` in the guest printed %q (%v), want status: error", id, out, err)
					}
					t.Logf("VM %s: `cloud-init status --wait --long` in the guest:\n%s", id, out)
				},
				Config:          cfg,
				ConfigVariables: config.Variables{"key": config.StringVariable(key)},
				Destroy:         true,
			},
		},
	})
}

// guestAfterFinish waits (bounded) until VM id's console shows cloud-init's
// final line and getty's login prompt, and returns the guest status then and
// the console.
func guestAfterFinish(t *testing.T, f *fleet, id string) (api.GuestStatus, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var console string
	for {
		var err error
		console, err = f.Control.Client.VMConsole(ctx, id, 1<<20)
		if err == nil && strings.Contains(console, " finished at ") && strings.Contains(console, " login: ") {
			g, err := f.Control.Client.VMGuest(ctx, id)
			if err != nil {
				t.Fatalf("GET /v1/vms/%s/guest: %v", id, err)
			}
			return g, console
		}
		select {
		case <-ctx.Done():
			t.Fatalf("VM %s: no final cloud-init line and login prompt on the console within 10 minutes (%v); it ends with:\n%s",
				id, err, tail(console, 4000))
		case <-time.After(5 * time.Second):
		}
	}
}

// debianGuestConfig is a kvm_vm "test" of the Debian 12 image with the SSH
// key of variable "key", a local-hostname, user data (each line indented
// by four spaces, as in a heredoc) and wait_for = "cloud_init", reachable
// on port 22 through a user-mode forward.
func debianGuestConfig(name, hostname, userData string) string {
	return `
variable "key" {
  type = string
}

resource "kvm_vm" "test" {
  name                = "` + name + `"
  image               = "debian-12"
  vcpus               = 2
  memory_mib          = 1024
  disk_mib            = 4096
  ssh_authorized_keys = [var.key]
  meta_data = {
    "local-hostname" = "` + hostname + `"
  }
  user_data = <<-EOT
` + userData + `  EOT
  wait_for = "cloud_init"

  network_interface {
    network = "default"
    port_forward {
      guest_port = 22
    }
  }

  timeouts {
    create = "15m"
  }
}
`
}
