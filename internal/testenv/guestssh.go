package testenv

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// GuestKey is an SSH key made for one test: the authorized_keys line the
// guest gets (api.VMCreate.SSHAuthorizedKeys) and the signer that logs in
// with it.
type GuestKey struct {
	Authorized string
	Signer     ssh.Signer
}

// NewGuestKey makes an ed25519 key for one test.
func NewGuestKey(t testing.TB) GuestKey {
	t.Helper()
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
	return GuestKey{Authorized: strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub))) + " test", Signer: signer}
}

// GuestSSH logs in as debian through the VM's first forward on 127.0.0.1
// (retrying while sshd comes up, at most a minute), runs cmd with stdin
// (nil: none) and returns its combined output; a command that fails fails
// the test with that output.
func GuestSSH(t testing.TB, vm api.VM, key GuestKey, cmd string, stdin io.Reader) string {
	t.Helper()
	if len(vm.NetworkInterfaces) == 0 || len(vm.NetworkInterfaces[0].PortForwards) == 0 {
		t.Fatalf("vm %s has no port forward: %+v", vm.ID, vm.NetworkInterfaces)
	}
	fwd := vm.NetworkInterfaces[0].PortForwards[0]
	cfg := &ssh.ClientConfig{User: "debian", Auth: []ssh.AuthMethod{ssh.PublicKeys(key.Signer)},
		// The host keys were made by cloud-init in this guest; the test
		// trusts the forward on 127.0.0.1 it just made.
		HostKeyCallback: ssh.InsecureIgnoreHostKey(), Timeout: 10 * time.Second}
	addr := net.JoinHostPort(fwd.HostAddress, strconv.Itoa(fwd.HostPort))
	var cl *ssh.Client
	var err error
	for i := 0; ; i++ {
		if cl, err = ssh.Dial("tcp", addr, cfg); err == nil {
			break
		}
		if i == 30 {
			t.Fatalf("ssh debian@%s (vm %s): %v", addr, vm.ID, err)
		}
		time.Sleep(2 * time.Second)
	}
	defer func() { _ = cl.Close() }()
	sess, err := cl.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sess.Close() }()
	sess.Stdin = stdin
	out, err := sess.CombinedOutput(cmd)
	if err != nil {
		t.Fatalf("ssh %q on vm %s: %v: %s", cmd, vm.ID, err, out)
	}
	return string(out)
}

// WaitCloudInitDone polls the guest status of vm id until cloud-init is
// done and returns how long that took from start; an error status or ten
// minutes fail the test with the console.
func (c *Control) WaitCloudInitDone(t testing.TB, id string, start time.Time) time.Duration {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(10 * time.Minute)
	for {
		g, err := c.Client.VMGuest(ctx, id)
		if err == nil && g.CloudInit == api.CloudInitDone {
			return time.Since(start)
		}
		if (err == nil && g.CloudInit == api.CloudInitError) || time.Now().After(deadline) {
			con, _ := c.Client.VMConsole(ctx, id, 64<<10)
			t.Fatalf("vm %s: cloud-init not done (guest %+v, %v); console:\n%s", id, g, err, con)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
