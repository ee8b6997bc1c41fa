package testenv

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// AgentDouble speaks the host agent API from memory, with switches that
// make it fail on purpose. Tests use it where a failure must be injected
// at one exact step; everything else runs against the real agent.
type AgentDouble struct {
	Address string // "http://127.0.0.1:port", the same as URL
	URL     string
	Token   string
	// key is the double's identity key: it proves itself like an agent.
	key ed25519.PrivateKey

	mu       sync.Mutex
	capacity agentapi.Resources
	images   []string
	vms      map[string]agentapi.VM
	specs    map[string]agentapi.VMSpec
	calls    []string
	failPut  bool
	onDelete func(id string)
	bridges  []string
	nextPort int
	srv      *http.Server
}

// AgentDoubleOptions configures StartAgentDouble.
type AgentDoubleOptions struct {
	Token     string // default "agent-token"
	VCPUs     int64  // default 16
	MemoryMiB int64  // default 65536
	DiskMiB   int64  // default 1 TiB
	Images    []string
	// Bridges are the bridges that exist on this host: a NIC of mode
	// bridge on another one is refused with the agent's "invalid" error.
	Bridges []string
}

// StartAgentDouble starts the double on 127.0.0.1; it stops at cleanup.
func StartAgentDouble(t testing.TB, opts AgentDoubleOptions) *AgentDouble {
	t.Helper()
	if opts.Token == "" {
		opts.Token = "agent-token"
	}
	if opts.VCPUs == 0 {
		opts.VCPUs = 16
	}
	if opts.MemoryMiB == 0 {
		opts.MemoryMiB = 65536
	}
	if opts.DiskMiB == 0 {
		opts.DiskMiB = 1 << 20
	}
	if len(opts.Images) == 0 {
		opts.Images = []string{"sim"}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("agent double: %v", err)
	}
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatalf("agent double: %v", err)
	}
	d := &AgentDouble{
		Address: "http://" + ln.Addr().String(), URL: "http://" + ln.Addr().String(), Token: opts.Token, key: key,
		capacity: agentapi.Resources{VCPUs: opts.VCPUs, MemoryMiB: opts.MemoryMiB, DiskMiB: opts.DiskMiB},
		images:   opts.Images, vms: map[string]agentapi.VM{}, specs: map[string]agentapi.VMSpec{}, bridges: opts.Bridges, nextPort: 20000,
	}
	d.srv = &http.Server{Handler: d.routes(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = d.srv.Serve(ln) }()
	t.Cleanup(func() { _ = d.srv.Close() })
	return d
}

// FailCreates makes PUT /v1/vms/{id} answer 500 (nothing is created).
func (d *AgentDouble) FailCreates(fail bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.failPut = fail
}

// OnDelete runs fn at the start of each DELETE /v1/vms/{id}, before the VM
// is removed: a test can look at the control plane's state at that moment.
func (d *AgentDouble) OnDelete(fn func(id string)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.onDelete = fn
}

// Stop makes the double stop answering (connections are refused).
func (d *AgentDouble) Stop() { _ = d.srv.Close() }

// Calls returns the mutating calls received, as "PUT <id>" / "DELETE <id>".
func (d *AgentDouble) Calls() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.calls)
}

// VMIDs returns the ids of the VMs the double holds.
func (d *AgentDouble) VMIDs() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var ids []string
	for id := range d.vms {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Forget drops a VM as if it vanished from the host behind everyone's back.
func (d *AgentDouble) Forget(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.vms, id)
}

func (d *AgentDouble) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/info", d.info)
	mux.HandleFunc("GET /v1/vms", d.list)
	mux.HandleFunc("PUT /v1/vms/{id}", d.put)
	mux.HandleFunc("GET /v1/vms/{id}", d.get)
	mux.HandleFunc("DELETE /v1/vms/{id}", d.delete)
	mux.HandleFunc("POST /v1/vms/{id}/{action}", d.action)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/v1/identity" {
			d.identity(w, r)
			return
		}
		if r.Header.Get("Authorization") != "Bearer "+d.Token {
			writeAgentError(w, http.StatusUnauthorized, "unauthorized", "unauthorized")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// identity answers a challenge as an agent does (it needs no token).
func (d *AgentDouble) identity(w http.ResponseWriter, r *http.Request) {
	var ch agentapi.IdentityChallenge
	if err := json.NewDecoder(r.Body).Decode(&ch); err != nil {
		writeAgentError(w, http.StatusBadRequest, "invalid", err.Error())
		return
	}
	if err := ch.Validate(); err != nil {
		writeAgentError(w, http.StatusBadRequest, "invalid", err.Error())
		return
	}
	writeAgentJSON(w, http.StatusOK, agentapi.ProveIdentity(d.key, d.Token, ch))
}

func (d *AgentDouble) info(w http.ResponseWriter, _ *http.Request) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var used agentapi.Resources
	for _, vm := range d.vms {
		used.VCPUs += vm.VCPUs
		used.MemoryMiB += vm.MemoryMiB
		used.DiskMiB += vm.DiskMiB
	}
	writeAgentJSON(w, http.StatusOK, agentapi.Info{
		Hostname: "double", Capacity: d.capacity, Allocated: used,
		Free: agentapi.Resources{VCPUs: d.capacity.VCPUs - used.VCPUs, MemoryMiB: d.capacity.MemoryMiB - used.MemoryMiB,
			DiskMiB: d.capacity.DiskMiB - used.DiskMiB},
		Accel: "tcg", Driver: "double", Images: d.images, VMCount: len(d.vms),
	})
}

func (d *AgentDouble) list(w http.ResponseWriter, _ *http.Request) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := agentapi.VMList{Items: []agentapi.VM{}}
	for _, vm := range d.vms {
		out.Items = append(out.Items, vm)
	}
	writeAgentJSON(w, http.StatusOK, out)
}

func (d *AgentDouble) put(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	var spec agentapi.VMSpec
	if err := json.NewDecoder(r.Body).Decode(&spec); err != nil {
		writeAgentError(w, http.StatusBadRequest, "invalid", err.Error())
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls = append(d.calls, "PUT "+id)
	d.specs[id] = spec
	if d.failPut {
		writeAgentError(w, http.StatusInternalServerError, "internal", "injected create failure")
		return
	}
	if vm, ok := d.vms[id]; ok {
		writeAgentJSON(w, http.StatusOK, vm)
		return
	}
	if !slices.Contains(d.images, spec.Image) {
		writeAgentError(w, http.StatusBadRequest, "invalid", "unknown image "+spec.Image)
		return
	}
	nics, err := d.attachNICs(spec.NICs)
	if err != nil {
		writeAgentError(w, http.StatusBadRequest, "invalid", err.Error())
		return
	}
	state := agentapi.StateRunning
	if spec.Stopped {
		state = agentapi.StateStopped
	}
	vm := agentapi.VM{ID: id, Image: spec.Image, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB, DiskMiB: spec.DiskMiB,
		State: state, StartedFrom: agentapi.StartedCold, CreatedAt: time.Now().UTC(), NICs: nics, GuestAgent: spec.GuestAgent}
	d.vms[id] = vm
	writeAgentJSON(w, http.StatusCreated, vm)
}

// attachNICs answers NICs the way the agent contract says: bridges must
// exist on the host (else the agent's "invalid" naming bridge and host),
// and each forward gets 127.0.0.1 and a host port of the double's choice.
// d.mu is held.
func (d *AgentDouble) attachNICs(in []agentapi.NIC) ([]agentapi.NIC, error) {
	out := make([]agentapi.NIC, 0, len(in))
	for _, n := range in {
		if n.Mode == agentapi.NetworkBridge && !slices.Contains(d.bridges, n.Bridge) {
			return nil, fmt.Errorf("network %q: bridge %q does not exist on host %s; create it there or limit the network's hosts", n.Network, n.Bridge, d.Address)
		}
		n.PortForwards = slices.Clone(n.PortForwards)
		for i := range n.PortForwards {
			n.PortForwards[i].HostAddress = "127.0.0.1"
			n.PortForwards[i].HostPort = d.nextPort
			d.nextPort++
		}
		out = append(out, n)
	}
	return out, nil
}

// NICs returns the NICs the double attached to a VM, as it answered them.
func (d *AgentDouble) NICs(id string) []agentapi.NIC {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.vms[id].NICs)
}

// ReportGuestAddresses makes the double answer GET /v1/vms/{id} with addrs
// as the addresses VM id's guest agent reports on its NIC nic, as an agent
// does for a VM with guest_agent.
func (d *AgentDouble) ReportGuestAddresses(id string, nic int, addrs ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	vm := d.vms[id]
	vm.NICs = slices.Clone(vm.NICs)
	vm.NICs[nic].IPv4Addresses = slices.Clone(addrs)
	d.vms[id] = vm
}

// Spec returns the last create spec the double received for a VM.
func (d *AgentDouble) Spec(id string) agentapi.VMSpec {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.specs[id]
}

func (d *AgentDouble) get(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	defer d.mu.Unlock()
	vm, ok := d.vms[r.PathValue("id")]
	if !ok {
		writeAgentError(w, http.StatusNotFound, "not_found", "no such vm")
		return
	}
	writeAgentJSON(w, http.StatusOK, vm)
}

func (d *AgentDouble) delete(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	d.mu.Lock()
	hook := d.onDelete
	d.calls = append(d.calls, "DELETE "+id)
	d.mu.Unlock()
	if hook != nil {
		hook(id)
	}
	d.mu.Lock()
	delete(d.vms, id)
	d.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (d *AgentDouble) action(w http.ResponseWriter, r *http.Request) {
	id, action := r.PathValue("id"), r.PathValue("action")
	d.mu.Lock()
	defer d.mu.Unlock()
	vm, ok := d.vms[id]
	if !ok {
		writeAgentError(w, http.StatusNotFound, "not_found", "no such vm")
		return
	}
	d.calls = append(d.calls, strings.ToUpper(action)+" "+id)
	switch action {
	case agentapi.ActionStart, agentapi.ActionResume:
		vm.State = agentapi.StateRunning
	case agentapi.ActionStop:
		vm.State = agentapi.StateStopped
	case agentapi.ActionPause:
		vm.State = agentapi.StatePaused
	default:
		writeAgentError(w, http.StatusNotFound, "not_found", "no such action")
		return
	}
	d.vms[id] = vm
	writeAgentJSON(w, http.StatusOK, vm)
}

// SetState changes a VM's state behind the control plane's back.
func (d *AgentDouble) SetState(id, state string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	vm, ok := d.vms[id]
	if !ok {
		return errors.New("no such vm " + id)
	}
	vm.State = state
	d.vms[id] = vm
	return nil
}

func writeAgentJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeAgentError(w http.ResponseWriter, status int, code, msg string) {
	writeAgentJSON(w, status, agentapi.ErrorBody{Error: agentapi.ErrorDetail{Code: code, Message: msg}})
}
