package faulttest

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// overlayFDBHost is a "host": a network namespace with a veth on the
// test's underlay bridge, running a real kvmd agent (sim driver) with its
// underlay address there.
type overlayFDBHost struct {
	name, ns, underlay, url, stateDir, bin string
	kill                                   func() // SIGKILL the agent and wait for it
}

func overlayFDBRun(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func startOverlayFDBHost(t *testing.T, bin string, i int) *overlayFDBHost {
	t.Helper()
	h := &overlayFDBHost{name: fmt.Sprintf("h%d", i), ns: fmt.Sprintf("kvfdb%d-h%d", os.Getpid(), i), underlay: fmt.Sprintf("10.95.0.%d", i),
		stateDir: t.TempDir(), bin: bin}
	h.url = "http://" + h.underlay + ":8471"
	overlayFDBRun(t, "ip", "netns", "add", h.ns)
	t.Cleanup(func() { _ = netns.DeleteNamed(h.ns) })
	out := fmt.Sprintf("ovfdb%d", i)
	overlayFDBRun(t, "ip", "link", "add", out, "master", "ovfdbul", "type", "veth", "peer", "name", "eth0", "netns", h.ns)
	overlayFDBRun(t, "ip", "link", "set", out, "up")
	overlayFDBRun(t, "ip", "-n", h.ns, "addr", "add", h.underlay+"/24", "dev", "eth0")
	overlayFDBRun(t, "ip", "-n", h.ns, "link", "set", "eth0", "up")
	overlayFDBRun(t, "ip", "-n", h.ns, "link", "set", "lo", "up")
	h.startAgent(t)
	return h
}

// startAgent starts the host's agent on its state directory, in its
// namespace, and waits for it to answer (also after a kill, to restart it).
func (h *overlayFDBHost) startAgent(t *testing.T) {
	t.Helper()
	log, err := os.CreateTemp(t.TempDir(), "agent-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", h.ns, h.bin, "agent", "--listen", h.underlay+":8471", "--state-dir", h.stateDir,
		"--driver", "sim", "--token", "agent-token", "--vcpus", "64", "--memory-mib", "262144", "--disk-mib", "4000000",
		"--underlay-address", h.underlay, "--log-level", "warn")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	h.kill = func() { _ = cmd.Process.Kill(); <-done }
	t.Cleanup(h.kill)
	eventually(t, "agent "+h.name+" answers", func() error {
		select {
		case <-done:
			b, _ := os.ReadFile(log.Name())
			t.Fatalf("agent %s exited:\n%s", h.name, b)
		default:
		}
		resp, err := http.Get(h.url + "/healthz")
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		return nil
	})
}

// kernelEntries lists, through netlink in the host's namespace, the
// permanent forwarding entries ("mac dst") and the neighbour entries ("ip
// mac") of every kvx- device, by device.
func (h *overlayFDBHost) kernelEntries(t *testing.T) map[string][]string {
	t.Helper()
	ns, err := netns.GetFromName(h.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ns.Close() }()
	nl, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	links, err := nl.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, l := range links {
		if _, ok := l.(*netlink.Vxlan); !ok || !strings.HasPrefix(l.Attrs().Name, "kvx-") {
			continue
		}
		list := []string{}
		fdb, err := nl.NeighList(l.Attrs().Index, unix.AF_BRIDGE)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range fdb {
			if e.State&netlink.NUD_PERMANENT != 0 && e.IP != nil {
				list = append(list, "fdb "+e.HardwareAddr.String()+" "+e.IP.String())
			}
		}
		neigh, err := nl.NeighList(l.Attrs().Index, unix.AF_INET)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range neigh {
			list = append(list, "neigh "+e.IP.String()+" "+e.HardwareAddr.String())
		}
		slices.Sort(list)
		out[l.Attrs().Name] = list
	}
	return out
}

// FDB agreement on real agents: after 50 creates and deletes spread over
// three hosts (network namespaces, kvmd agents with the sim driver) and two
// overlay networks, every host's forwarding and neighbour entries, listed
// through netlink in its namespace, equal what the database says, and a
// host with no VM of a network left has no VXLAN device for it.
func TestOverlayFDBAgreesWithTheDatabase(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	bin := buildKVMD(t)
	ctx := ctxT(t, 10*time.Minute)
	overlayFDBRun(t, "ip", "link", "add", "ovfdbul", "type", "bridge")
	overlayFDBRun(t, "ip", "addr", "add", "10.95.0.254/24", "dev", "ovfdbul")
	overlayFDBRun(t, "ip", "link", "set", "ovfdbul", "up")
	c := testenv.StartControl(t, testenv.ControlOptions{AllowInsecureAgents: true})
	hosts := map[string]*overlayFDBHost{}
	for i := 1; i <= 3; i++ {
		h := startOverlayFDBHost(t, bin, i)
		hosts[h.name] = h
		if _, err := c.Client.PutHost(ctx, h.name, api.HostPut{Address: h.url, UnderlayAddress: h.underlay}); err != nil {
			t.Fatalf("register %s: %v", h.name, err)
		}
	}
	devices := map[string]string{}
	for i, cidr := range []string{"10.41.0.0/24", "10.42.0.0/24"} {
		name := fmt.Sprintf("ov%d", i+1)
		if _, err := c.Client.CreateNetwork(ctx, api.NetworkCreate{Name: name, Mode: api.NetworkOverlay, CIDR: cidr}); err != nil {
			t.Fatal(err)
		}
		devices[name] = network.VXLANName(name)
	}
	var live []api.VM
	for i := range 50 {
		if i%3 == 2 && len(live) > 0 {
			victim := live[(i*7)%len(live)]
			if err := c.Client.DeleteVM(ctx, victim.ID); err != nil {
				t.Fatal(err)
			}
			live = slices.DeleteFunc(live, func(v api.VM) bool { return v.ID == victim.ID })
			continue
		}
		in := smallVM(fmt.Sprintf("fdb-%d", i))
		in.Host = fmt.Sprintf("h%d", i%3+1)
		in.NetworkInterfaces = []api.NetworkInterface{{Network: fmt.Sprintf("ov%d", i%2+1)}}
		vm, err := c.Client.CreateVM(ctx, in, "")
		if err != nil {
			t.Fatalf("create %s on %s: %v", in.Name, in.Host, err)
		}
		live = append(live, vm)
	}
	// One network leaves h3 entirely: its device there must go.
	for _, vm := range slices.Clone(live) {
		if vm.Host == "h3" && vm.NetworkInterfaces[0].Network == "ov1" {
			if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
				t.Fatal(err)
			}
		}
	}

	want := func() map[string]map[string][]string {
		list, err := c.Client.ListVMs(ctx, client.ListOptions{PageSize: api.MaxPageSize})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]map[string][]string{}
		for h := range hosts {
			out[h] = map[string][]string{}
		}
		for _, a := range list.Items {
			n := a.NetworkInterfaces[0]
			dev := devices[n.Network]
			if _, ok := out[a.Host][dev]; !ok {
				out[a.Host][dev] = []string{}
			}
			for _, b := range list.Items {
				m := b.NetworkInterfaces[0]
				if b.Host != a.Host && m.Network == n.Network && !slices.Contains(out[a.Host][dev], "fdb "+m.MACAddress+" "+hosts[b.Host].underlay) {
					out[a.Host][dev] = append(out[a.Host][dev], "fdb "+m.MACAddress+" "+hosts[b.Host].underlay, "neigh "+m.IPv4Address+" "+m.MACAddress)
				}
			}
			slices.Sort(out[a.Host][dev])
		}
		return out
	}
	var got, w map[string]map[string][]string
	deadline := time.Now().Add(2 * time.Minute)
	for {
		w = want()
		got = map[string]map[string][]string{}
		for name, h := range hosts {
			got[name] = h.kernelEntries(t)
		}
		if reflect.DeepEqual(got, w) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the hosts' kernels do not agree with the database:\n got  %v\n want %v", got, w)
		}
		time.Sleep(100 * time.Millisecond)
	}
	n := 0
	for _, devs := range w {
		for _, l := range devs {
			n += len(l)
		}
	}
	if _, ok := w["h3"][devices["ov1"]]; ok || n == 0 {
		t.Fatalf("the churn did not leave the expected shape: %v", w)
	}
	t.Logf("%d kernel entries on 3 hosts agree with the database", n)

	// Restarts change nothing. With the control plane stopped (so that no
	// push can put back what a restart took away), h2's agent is killed
	// with SIGKILL and started again on its state directory in its
	// namespace: every host's kernel entries are as they were once it
	// answers. The control plane then starts again on its database, its
	// monitor off: still as they were; after one monitor round, still as
	// they were, and equal to the database.
	all := func() map[string]map[string][]string {
		out := map[string]map[string][]string{}
		for name, h := range hosts {
			out[name] = h.kernelEntries(t)
		}
		return out
	}
	before := all()
	c.Stop()
	hosts["h2"].kill()
	hosts["h2"].startAgent(t)
	if got := all(); !reflect.DeepEqual(got, before) {
		t.Fatalf("h2's agent restart changed the kernel entries:\n got  %v\n want %v", got, before)
	}
	c = testenv.StartControl(t, testenv.ControlOptions{AllowInsecureAgents: true, DataDir: c.DataDir, NoMonitor: true})
	if got := all(); !reflect.DeepEqual(got, before) {
		t.Fatalf("the control plane's restart changed the kernel entries:\n got  %v\n want %v", got, before)
	}
	// One entry taken away behind the agent's back comes back in the
	// round: the round did push to the restarted agents.
	var dev, entry string
	for d, l := range before["h1"] {
		for _, e := range l {
			if strings.HasPrefix(e, "fdb ") {
				dev, entry = d, e
			}
		}
	}
	if entry == "" {
		t.Fatalf("h1 has no forwarding entry: %v", before["h1"])
	}
	f := strings.Fields(entry)
	overlayFDBRun(t, "ip", "netns", "exec", hosts["h1"].ns, "bridge", "fdb", "del", f[1], "dev", dev, "dst", f[2], "self")
	if got := hosts["h1"].kernelEntries(t); reflect.DeepEqual(got, before["h1"]) {
		t.Fatalf("%s still on h1 after its delete", entry)
	}
	c.Service.SyncNow(ctx)
	if got, w := all(), want(); !reflect.DeepEqual(got, before) || !reflect.DeepEqual(got, w) {
		t.Fatalf("after the restarts and a monitor round the kernel entries changed or disagree with the database:\n got    %v\n before %v\n db     %v", got, before, w)
	}
	t.Logf("agent kill -9 and restart, control plane restart, a monitor round: the %d kernel entries unchanged", n)
}
