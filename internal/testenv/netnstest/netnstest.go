// Package netnstest runs a test in a network namespace of its own, so that
// what it does to the network (bridges, taps, NAT rules, traffic to guests)
// never reaches the machine's own namespace. It imports nothing of the
// product, so any package's tests can use it.
package netnstest

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

// envVar names the test that runs inside its namespace.
const envVar = "KVM_TEST_NETNS"

// InOwnNetNS runs the calling test again in a process of its own in a new
// network namespace (unshare -n) and reports its result there; it returns
// true in that process, where the test goes on with loopback up and nothing
// else. It skips when not root or without unshare.
func InOwnNetNS(t *testing.T) bool {
	t.Helper()
	if os.Getenv(envVar) == t.Name() {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			t.Fatal(err)
		}
		return true
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: the test makes a network namespace with bridges, taps and NAT rules (CI runs it as root)")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skipf("needs unshare (util-linux) to make a network namespace: %v", err)
	}
	cmd := exec.Command(unshare, "-n", "--", os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1", "-test.timeout=30m")
	cmd.Env = append(os.Environ(), envVar+"="+t.Name())
	out, err := cmd.CombinedOutput()
	t.Logf("test process in its own network namespace:\n%s", out)
	switch {
	case err != nil:
		t.Fatalf("the test failed in its network namespace: %v", err)
	case strings.Contains(string(out), "--- SKIP: "+t.Name()):
		t.Skip("skipped in its network namespace")
	case !strings.Contains(string(out), "--- PASS: "+t.Name()):
		t.Fatal("the test did not pass in its network namespace")
	}
	return false
}
