package control_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// overlayRecorder stands in front of a sim agent for the overlay half of
// the agent API: it answers PUT, DELETE and GET /v1/overlays from memory
// and records every PUT and DELETE. It answers identity challenges that
// name an underlay address as an agent started with --underlay-address
// does (its own address only, signed with the sim agent's key, read from
// its state directory: the sim agent runs in this namespace, where the
// fleet's underlay addresses are on no interface), and passes the other
// challenges to the sim agent, which signs for the recorder's address.
// Everything else goes to the sim agent too,
// with overlay NICs turned into nat ones (the sim agent of this branch
// knows no overlay mode; the VM specs are recorded as the control sent
// them).
type overlayRecorder struct {
	URL      string
	underlay string
	token    string

	mu    sync.Mutex
	state map[string]agentapi.Overlay
	calls []overlayCall
	specs map[string][]agentapi.NIC
}

type overlayCall struct {
	Method  string
	Network string
	Body    agentapi.Overlay
}

func startOverlayRecorder(t testing.TB, underlay string, agentOpts testenv.AgentOptions) *overlayRecorder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if agentOpts.Driver == "" {
		agentOpts.Driver = "sim"
	}
	self := "http://" + ln.Addr().String()
	agentOpts.Addresses = append(agentOpts.Addresses, self)
	ag := testenv.StartAgent(t, agentOpts)
	key := overlayAgentKey(t, ag.StateDir)
	target, err := url.Parse(ag.URL)
	if err != nil {
		t.Fatal(err)
	}
	r := &overlayRecorder{URL: self, underlay: underlay, token: ag.Token,
		state: map[string]agentapi.Overlay{}, specs: map[string][]agentapi.NIC{}}
	proxy := httputil.NewSingleHostReverseProxy(target)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/identity", func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		var ch agentapi.IdentityChallenge
		if err != nil || json.Unmarshal(body, &ch) != nil {
			overlayAgentError(w, http.StatusBadRequest, "invalid", "bad challenge")
			return
		}
		if ch.Underlay != "" {
			switch {
			case ch.Validate() != nil:
				overlayAgentError(w, http.StatusBadRequest, "invalid", "bad challenge")
			case ch.Address != self || ch.Underlay != r.underlay:
				overlayAgentError(w, http.StatusForbidden, "forbidden", "not my address or underlay address")
			default:
				overlayAgentJSON(w, http.StatusOK, agentapi.ProveIdentity(key, ag.Token, ch))
			}
			return
		}
		req.Body = io.NopCloser(bytes.NewReader(body))
		proxy.ServeHTTP(w, req)
	})
	mux.HandleFunc("GET /v1/overlays", r.authorized(r.list))
	mux.HandleFunc("PUT /v1/overlays/{network}", r.authorized(r.put))
	mux.HandleFunc("DELETE /v1/overlays/{network}", r.authorized(r.delete))
	mux.HandleFunc("/", func(w http.ResponseWriter, req *http.Request) {
		if req.Body != nil && req.Method != http.MethodGet {
			body, err := io.ReadAll(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			if id, ok := strings.CutPrefix(req.URL.Path, "/v1/vms/"); ok && req.Method == http.MethodPut && !strings.Contains(id, "/") {
				var spec agentapi.VMSpec
				if json.Unmarshal(body, &spec) == nil {
					r.mu.Lock()
					r.specs[id] = spec.NICs
					r.mu.Unlock()
				}
			}
			body = bytes.ReplaceAll(body, []byte(`"mode":"overlay"`), []byte(`"mode":"nat"`))
			req.Body = io.NopCloser(bytes.NewReader(body))
			req.ContentLength = int64(len(body))
		}
		proxy.ServeHTTP(w, req)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return r
}

func (r *overlayRecorder) authorized(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		if req.Header.Get("Authorization") != "Bearer "+r.token {
			overlayAgentError(w, http.StatusUnauthorized, "unauthorized", "unauthorized")
			return
		}
		h(w, req)
	}
}

func (r *overlayRecorder) put(w http.ResponseWriter, req *http.Request) {
	var o agentapi.Overlay
	if err := json.NewDecoder(req.Body).Decode(&o); err != nil || o.Network != req.PathValue("network") {
		overlayAgentError(w, http.StatusBadRequest, "invalid", "bad overlay")
		return
	}
	if r.underlay == "" {
		overlayAgentError(w, http.StatusConflict, "conflict", "no underlay address")
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.state[o.Network] = o
	r.calls = append(r.calls, overlayCall{Method: http.MethodPut, Network: o.Network, Body: o})
	overlayAgentJSON(w, http.StatusOK, overlayStateOf(o))
}

func (r *overlayRecorder) delete(w http.ResponseWriter, req *http.Request) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.state, req.PathValue("network"))
	r.calls = append(r.calls, overlayCall{Method: http.MethodDelete, Network: req.PathValue("network")})
	w.WriteHeader(http.StatusNoContent)
}

func (r *overlayRecorder) list(w http.ResponseWriter, _ *http.Request) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := []agentapi.OverlayState{}
	for _, o := range r.state {
		out = append(out, overlayStateOf(o))
	}
	overlayAgentJSON(w, http.StatusOK, out)
}

// overlayStateOf is what an agent that programmed o reports.
func overlayStateOf(o agentapi.Overlay) agentapi.OverlayState {
	s := agentapi.OverlayState{Network: o.Network, VNI: o.VNI, MTU: o.MTU, FDB: []agentapi.OverlayFDB{}, Neigh: []agentapi.OverlayNeigh{}}
	for _, e := range o.Entries {
		s.FDB = append(s.FDB, agentapi.OverlayFDB{MAC: e.MAC, Dst: e.Underlay})
		s.Neigh = append(s.Neigh, agentapi.OverlayNeigh{IPv4: e.IPv4, MAC: e.MAC})
	}
	return s
}

// entries is the host's programmed state: network -> sorted "mac ip underlay".
func (r *overlayRecorder) entries() map[string][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string][]string{}
	for n, o := range r.state {
		list := []string{}
		for _, e := range o.Entries {
			list = append(list, e.MAC+" "+e.IPv4+" "+e.Underlay)
		}
		slices.Sort(list)
		out[n] = list
	}
	return out
}

func (r *overlayRecorder) overlay(network string) (agentapi.Overlay, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	o, ok := r.state[network]
	return o, ok
}

func (r *overlayRecorder) deletes(network string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, c := range r.calls {
		if c.Method == http.MethodDelete && c.Network == network {
			n++
		}
	}
	return n
}

func (r *overlayRecorder) nicsSent(id string) []agentapi.NIC {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.specs[id]
}

// overlayAgentKey reads a sim agent's identity key from its state directory.
func overlayAgentKey(t testing.TB, stateDir string) ed25519.PrivateKey {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(stateDir, "identity.key"))
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatal("identity.key is not PEM")
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	key, ok := k.(ed25519.PrivateKey)
	if err != nil || !ok {
		t.Fatalf("identity.key is not an ed25519 key: %v", err)
	}
	return key
}

func overlayAgentJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func overlayAgentError(w http.ResponseWriter, status int, code, msg string) {
	overlayAgentJSON(w, status, agentapi.ErrorBody{Error: agentapi.ErrorDetail{Code: code, Message: msg}})
}

// overlayFleet is a control plane with hosts h1..hn behind overlay
// recorders, with underlay addresses 10.99.0.i, each labelled node=hi.
type overlayFleet struct {
	c     *testenv.Control
	hosts map[string]*overlayRecorder
	under map[string]string
}

func startOverlayFleet(t testing.TB, dbURL string, n int) overlayFleet {
	t.Helper()
	f := overlayFleet{c: testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL}), hosts: map[string]*overlayRecorder{}, under: map[string]string{}}
	for i := 1; i <= n; i++ {
		name, under := fmt.Sprintf("h%d", i), fmt.Sprintf("10.99.0.%d", i)
		f.hosts[name] = startOverlayRecorder(t, under, testenv.AgentOptions{VCPUs: 32, MemoryMiB: 64 << 10, DiskMiB: 1 << 20})
		f.under[name] = under
		h, err := f.c.Client.PutHost(context.Background(), name, api.HostPut{Address: f.hosts[name].URL, UnderlayAddress: under,
			Labels: map[string]string{"node": name}})
		if err != nil {
			t.Fatalf("register %s with underlay %s: %v", name, under, err)
		}
		if h.UnderlayAddress != under {
			t.Fatalf("host %s answers underlay_address %q; want %s", name, h.UnderlayAddress, under)
		}
	}
	return f
}

// want is what each host must have programmed, from the VMs' API answers:
// per host and overlay network with a NIC there, the NICs of that network
// on the other hosts with their host's underlay address.
func (f overlayFleet) want(ctx context.Context, t *testing.T) map[string]map[string][]string {
	t.Helper()
	vms, err := f.c.Client.ListVMs(ctx, client.ListOptions{PageSize: api.MaxPageSize})
	if err != nil {
		t.Fatal(err)
	}
	type nic struct{ host, network, line string }
	var all []nic
	for _, vm := range vms.Items {
		if api.Gone(vm.ObservedState) {
			continue
		}
		for _, n := range vm.NetworkInterfaces {
			if strings.HasPrefix(n.Network, "ov") {
				all = append(all, nic{vm.Host, n.Network, n.MACAddress + " " + n.IPv4Address + " " + f.under[vm.Host]})
			}
		}
	}
	out := map[string]map[string][]string{}
	for h := range f.hosts {
		out[h] = map[string][]string{}
	}
	for _, a := range all {
		if _, ok := out[a.host][a.network]; ok {
			continue
		}
		list := []string{}
		for _, b := range all {
			if b.network == a.network && b.host != a.host {
				list = append(list, b.line)
			}
		}
		slices.Sort(list)
		out[a.host][a.network] = list
	}
	return out
}

// agree waits until every host's programmed entries equal want.
func (f overlayFleet) agree(ctx context.Context, t *testing.T, what string) map[string]map[string][]string {
	t.Helper()
	var want map[string]map[string][]string
	var got map[string]map[string][]string
	deadline := time.Now().Add(60 * time.Second)
	for {
		want = f.want(ctx, t)
		got = map[string]map[string][]string{}
		for h, r := range f.hosts {
			got[h] = r.entries()
		}
		if reflect.DeepEqual(want, got) {
			return want
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the hosts' overlay entries do not follow the database:\n got  %v\n want %v", what, got, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (f overlayFleet) vm(ctx context.Context, t testing.TB, name, host string, networks ...string) api.VM {
	t.Helper()
	in := smallVM(name)
	in.Host = host
	for _, n := range networks {
		in.NetworkInterfaces = append(in.NetworkInterfaces, api.NetworkInterface{Network: n})
	}
	vm, err := f.c.Client.CreateVM(ctx, in, "")
	if err != nil {
		t.Fatalf("create %s on %s: %v", name, host, err)
	}
	return vm
}

// The entries follow creates on three hosts, a delete (the host that lost
// its last VM of the network gets a DELETE), a fork child on another host
// and a migration (the VM's entry moves to its new host's underlay).
func TestOverlayEntriesFollowTheVMs(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startOverlayFleet(t, dbURL, 3)
		ov, err := f.c.Client.CreateNetwork(ctx, api.NetworkCreate{Name: "ov1", Mode: api.NetworkOverlay, CIDR: "10.40.0.0/24"})
		if err != nil {
			t.Fatal(err)
		}
		if ov.VNI != api.OverlayFirstAutoVNI || ov.MTU != api.OverlayDefaultMTU || ov.Gateway != "10.40.0.1" {
			t.Fatalf("overlay network answers vni %d, mtu %d, gateway %s; want %d, %d, 10.40.0.1", ov.VNI, ov.MTU, ov.Gateway,
				api.OverlayFirstAutoVNI, api.OverlayDefaultMTU)
		}
		a := f.vm(ctx, t, "a", "h1", "ov1")
		b := f.vm(ctx, t, "b", "h2", "ov1")
		c := f.vm(ctx, t, "c", "h3", "ov1")
		want := f.agree(ctx, t, "after creates on 3 hosts")
		if len(want["h1"]["ov1"]) != 2 {
			t.Fatalf("h1 should have the 2 NICs of the other hosts, want is %v", want)
		}
		addrs := map[string]bool{}
		for _, vm := range []api.VM{a, b, c} {
			addrs[vm.NetworkInterfaces[0].IPv4Address] = true
		}
		if len(addrs) != 3 {
			t.Fatalf("the VMs on three hosts share addresses: %v", addrs)
		}
		nics := f.hosts["h1"].nicsSent(a.ID)
		if len(nics) != 1 || nics[0].Mode != api.NetworkOverlay || nics[0].VNI != api.OverlayFirstAutoVNI || nics[0].MTU != api.OverlayDefaultMTU ||
			nics[0].CIDR != "10.40.0.0/24" || nics[0].Gateway != "10.40.0.1" || nics[0].IPv4Address != a.NetworkInterfaces[0].IPv4Address {
			t.Fatalf("the NIC sent to h1's agent is %+v; want mode overlay, vni %d, mtu %d, the network's cidr and gateway and the VM's address",
				nics, api.OverlayFirstAutoVNI, api.OverlayDefaultMTU)
		}
		o, _ := f.hosts["h1"].overlay("ov1")
		peers := []agentapi.OverlayPeer{{Host: "h2", Underlay: "10.99.0.2"}, {Host: "h3", Underlay: "10.99.0.3"}}
		if o.VNI != api.OverlayFirstAutoVNI || o.MTU != api.OverlayDefaultMTU || o.CIDR != "10.40.0.0/24" || !reflect.DeepEqual(o.Peers, peers) {
			t.Fatalf("h1's overlay is %+v; want vni %d, mtu %d, cidr 10.40.0.0/24, peers %v", o, api.OverlayFirstAutoVNI, api.OverlayDefaultMTU, peers)
		}

		if err := f.c.Client.DeleteVM(ctx, c.ID); err != nil {
			t.Fatal(err)
		}
		f.agree(ctx, t, "after the delete of h3's VM")
		if f.hosts["h3"].deletes("ov1") == 0 {
			t.Fatal("h3 lost its last VM of ov1 but got no DELETE /v1/overlays/ov1")
		}

		fork, err := f.c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: a.ID, Count: 1,
			Constraints: &api.Constraints{HostLabels: map[string]string{"node": "h3"}}}, "")
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, "fork ready", func() bool {
			got, err := f.c.Client.GetFork(ctx, fork.ID)
			return err == nil && got.Phase == api.ForkReady
		})
		got, _ := f.c.Client.GetFork(ctx, fork.ID)
		child := got.Children[0]
		if child.Host != "h3" || child.NetworkInterfaces[0].IPv4Address == a.NetworkInterfaces[0].IPv4Address {
			t.Fatalf("fork child %s on %s at %s; want on h3 with an address of its own", child.ID, child.Host, child.NetworkInterfaces[0].IPv4Address)
		}
		want = f.agree(ctx, t, "after a fork child on h3")
		if !slices.Contains(want["h1"]["ov1"], child.NetworkInterfaces[0].MACAddress+" "+child.NetworkInterfaces[0].IPv4Address+" 10.99.0.3") {
			t.Fatalf("h1 should reach the fork child through h3's underlay: %v", want["h1"])
		}

		moved, err := f.c.Client.MigrateVM(ctx, b.ID, "h3")
		if err != nil {
			t.Fatalf("migrate b to h3: %v", err)
		}
		if moved.Host != "h3" || moved.NetworkInterfaces[0].IPv4Address != b.NetworkInterfaces[0].IPv4Address {
			t.Fatalf("b after the migration: on %s at %s; want on h3 at %s", moved.Host, moved.NetworkInterfaces[0].IPv4Address, b.NetworkInterfaces[0].IPv4Address)
		}
		want = f.agree(ctx, t, "after b's migration to h3")
		if !slices.Contains(want["h1"]["ov1"], b.NetworkInterfaces[0].MACAddress+" "+b.NetworkInterfaces[0].IPv4Address+" 10.99.0.3") {
			t.Fatalf("h1 should reach b at h3's underlay after the migration: %v", want["h1"])
		}
		if _, ok := f.hosts["h2"].overlay("ov1"); ok || f.hosts["h2"].deletes("ov1") == 0 {
			t.Fatal("h2 has no VM of ov1 left after the migration but still has the overlay")
		}
	})
}

// FDB agreement under churn: 50 creates and deletes spread over three
// hosts and two overlay networks, after which every host's programmed
// entries (as its GET /v1/overlays would list them) equal the database.
func TestOverlayEntriesAgreeAfterChurn(t *testing.T) {
	ctx := ctxT(t)
	f := startOverlayFleet(t, "", 3)
	for i, cidr := range []string{"10.41.0.0/24", "10.42.0.0/24"} {
		if _, err := f.c.Client.CreateNetwork(ctx, api.NetworkCreate{Name: fmt.Sprintf("ov%d", i+1), Mode: api.NetworkOverlay, CIDR: cidr}); err != nil {
			t.Fatal(err)
		}
	}
	var live []api.VM
	for i := range 50 {
		if i%3 == 2 && len(live) > 0 {
			victim := live[(i*7)%len(live)]
			if err := f.c.Client.DeleteVM(ctx, victim.ID); err != nil {
				t.Fatal(err)
			}
			live = slices.DeleteFunc(live, func(v api.VM) bool { return v.ID == victim.ID })
			continue
		}
		host := fmt.Sprintf("h%d", i%3+1)
		live = append(live, f.vm(ctx, t, fmt.Sprintf("churn-%d", i), host, fmt.Sprintf("ov%d", i%2+1)))
	}
	want := f.agree(ctx, t, "after 50 creates and deletes")
	n := 0
	for _, nets := range want {
		for _, list := range nets {
			n += len(list)
		}
	}
	if n == 0 {
		t.Fatal("no entries expected at all: the churn left nothing to compare")
	}
}

// Bad input: overlapping CIDRs and VNI clashes are 409 naming the other
// network, out-of-range VNI and MTU 400, a pinned host without an underlay
// address 409 with reason network, and an underlay address its agent does
// not prove is refused at registration.
func TestOverlayRefusals(t *testing.T) {
	ctx := ctxT(t)
	f := startOverlayFleet(t, "", 1)
	c := noRetry(f.c)
	if _, err := c.CreateNetwork(ctx, api.NetworkCreate{Name: "natx", Mode: api.NetworkNAT, CIDR: "10.50.0.0/24"}); err != nil {
		t.Fatal(err)
	}
	_, err := c.CreateNetwork(ctx, api.NetworkCreate{Name: "ovx", Mode: api.NetworkOverlay, CIDR: "10.50.0.128/25"})
	if apiCode(err) != api.CodeConflict || !strings.Contains(err.Error(), `"natx"`) {
		t.Fatalf("overlay overlapping natx: %v; want 409 naming natx", err)
	}
	if _, err := c.CreateNetwork(ctx, api.NetworkCreate{Name: "ov-a", Mode: api.NetworkOverlay, CIDR: "10.51.0.0/24", VNI: ptr(int64(5000))}); err != nil {
		t.Fatal(err)
	}
	_, err = c.CreateNetwork(ctx, api.NetworkCreate{Name: "ov-b", Mode: api.NetworkOverlay, CIDR: "10.52.0.0/24", VNI: ptr(int64(5000))})
	if apiCode(err) != api.CodeConflict || !strings.Contains(err.Error(), `"ov-a"`) {
		t.Fatalf("vni 5000 twice: %v; want 409 naming ov-a", err)
	}
	for name, in := range map[string]api.NetworkCreate{
		"vni 0":         {VNI: ptr(int64(0))},
		"vni 2^24":      {VNI: ptr(int64(1 << 24))},
		"mtu 575":       {MTU: ptr(int64(575))},
		"mtu 8951":      {MTU: ptr(int64(8951))},
		"no cidr":       {CIDR: "-"},
		"vni on nat":    {Mode: api.NetworkNAT, VNI: ptr(int64(7))},
		"bridge given":  {Bridge: "br0"},
		"mtu on bridge": {Mode: api.NetworkBridge, Bridge: "br0", MTU: ptr(int64(1400))},
	} {
		in.Name = "ov-bad"
		if in.Mode == "" {
			in.Mode = api.NetworkOverlay
		}
		switch in.CIDR {
		case "":
			in.CIDR = "10.53.0.0/24"
		case "-":
			in.CIDR = ""
		}
		if _, err := c.CreateNetwork(ctx, in); apiCode(err) != api.CodeInvalid {
			t.Errorf("%s: %v; want 400 invalid", name, err)
		}
	}
	ov, err := c.CreateNetwork(ctx, api.NetworkCreate{Name: "ov-c", Mode: api.NetworkOverlay, CIDR: "10.54.0.0/24", Gateway: "10.54.0.254", MTU: ptr(int64(8950))})
	if err != nil || ov.MTU != 8950 || ov.VNI != api.OverlayFirstAutoVNI || ov.Gateway != "10.54.0.254" {
		t.Fatalf("ov-c: %+v, %v; want mtu 8950, vni %d, gateway 10.54.0.254", ov, err, api.OverlayFirstAutoVNI)
	}

	// A host registered without an underlay address takes no overlay NIC.
	plain := testenv.StartAgent(t, testenv.AgentOptions{Driver: "sim"})
	f.c.RegisterHost(t, "plain", plain.Address)
	in := smallVM("needs-underlay")
	in.Host = "plain"
	in.NetworkInterfaces = []api.NetworkInterface{{Network: "ov-c"}}
	_, err = c.CreateVM(ctx, in, "")
	var ce *client.Error
	if !errors.As(err, &ce) || ce.Status != http.StatusConflict || !strings.Contains(ce.Message, "underlay_address") {
		t.Fatalf("overlay NIC pinned to a host without underlay address: %v; want 409 saying to register its underlay_address", err)
	}
	if rs, _ := ce.Details["rejected"].([]any); len(rs) != 1 || rs[0].(map[string]any)["reason"] != "network" {
		t.Fatalf("rejections %v; want one with reason network", ce.Details["rejected"])
	}
	in.Host = ""
	vm, err := c.CreateVM(ctx, in, "")
	if err != nil || vm.Host != "h1" {
		t.Fatalf("unpinned overlay VM: %v on %q; want it placed on h1, the host with an underlay address", err, vm.Host)
	}

	// An underlay address the agent does not have is not proved.
	other := startOverlayRecorder(t, "10.99.0.5", testenv.AgentOptions{})
	_, err = c.PutHost(ctx, "h5", api.HostPut{Address: other.URL, UnderlayAddress: "10.99.0.9"})
	if apiCode(err) != api.CodeInvalid || !strings.Contains(err.Error(), "underlay") {
		t.Fatalf("register h5 with an underlay address its agent does not prove: %v; want 400 naming the underlay address", err)
	}
	if _, err := c.GetHost(ctx, "h5"); apiCode(err) != api.CodeNotFound {
		t.Fatalf("h5 was registered although its underlay address was not proved: %v", err)
	}
	if _, err := c.PutHost(ctx, "h5", api.HostPut{Address: other.URL, UnderlayAddress: "10.99.0.300"}); apiCode(err) != api.CodeInvalid {
		t.Fatalf("underlay address 10.99.0.300: %v; want 400", err)
	}
	if h, err := c.PutHost(ctx, "h5", api.HostPut{Address: other.URL, UnderlayAddress: "10.99.0.5"}); err != nil || h.UnderlayAddress != "10.99.0.5" {
		t.Fatalf("h5 with its own underlay address: %+v, %v", h, err)
	}
}

// Two replicas on one PostgreSQL database creating overlay networks
// without a vni at once never hand out the same one.
func TestOverlayVNIsUniqueAcrossReplicas(t *testing.T) {
	ctx := ctxT(t)
	dbURL := testenv.PostgresURL(t)
	replicas := []*testenv.Control{testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL}),
		testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL})}
	const n = 24
	vnis := make([]int64, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			nw, err := noRetry(replicas[i%2]).CreateNetwork(ctx, api.NetworkCreate{Name: fmt.Sprintf("ov-%d", i), Mode: api.NetworkOverlay,
				CIDR: fmt.Sprintf("10.60.%d.0/24", i)})
			vnis[i], errs[i] = nw.VNI, err
		})
	}
	wg.Wait()
	seen := map[int64]int{}
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("create ov-%d: %v", i, errs[i])
		}
		if j, dup := seen[vnis[i]]; dup {
			t.Fatalf("ov-%d and ov-%d both got vni %d", j, i, vnis[i])
		}
		seen[vnis[i]] = i
		if vnis[i] < api.OverlayFirstAutoVNI || vnis[i] >= api.OverlayFirstAutoVNI+n {
			t.Errorf("ov-%d got vni %d; want the lowest free ones, %d to %d", i, vnis[i], api.OverlayFirstAutoVNI, api.OverlayFirstAutoVNI+n-1)
		}
	}
}

// BenchmarkOverlayEntryPropagation measures how long a new VM's entry
// takes to reach the two other hosts of a three-host overlay: from the
// create's request until both hosts' agents have accepted it (the kick
// after the reservation pushes it while the VM is being created). Each host has a VM of the network already. It reports the p50
// and p90 over b.N creates.
func BenchmarkOverlayEntryPropagation(b *testing.B) {
	ctx := context.Background()
	f := startOverlayFleet(b, "", 3)
	if _, err := f.c.Client.CreateNetwork(ctx, api.NetworkCreate{Name: "ov1", Mode: api.NetworkOverlay, CIDR: "10.40.0.0/20"}); err != nil {
		b.Fatal(err)
	}
	// Each host has the network (a host without a VM of it gets no entries).
	for _, h := range []string{"h1", "h2", "h3"} {
		f.vm(ctx, b, "seed-"+h, h, "ov1")
	}
	var took []time.Duration
	for i := 0; b.Loop(); i++ {
		host := fmt.Sprintf("h%d", i%3+1)
		start := time.Now()
		vm := f.vm(ctx, b, fmt.Sprintf("p-%d", i), host, "ov1")
		line := vm.NetworkInterfaces[0].MACAddress + " " + vm.NetworkInterfaces[0].IPv4Address + " " + f.under[host]
		for {
			n := 0
			for name, r := range f.hosts {
				if name != host && slices.Contains(r.entries()["ov1"], line) {
					n++
				}
			}
			if n == 2 {
				break
			}
			if time.Since(start) > time.Minute {
				b.Fatalf("vm %s's entry did not reach the other hosts", vm.ID)
			}
			time.Sleep(200 * time.Microsecond)
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(took[len(took)*9/10].Microseconds())/1000, "p90-ms")
}
