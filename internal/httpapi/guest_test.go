package httpapi_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// testAuthorizedKey is a fresh ed25519 public key in authorized_keys form.
func testAuthorizedKey(t *testing.T) string {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	sp, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sp))) + " test@kvm"
}

// Bad guest configuration is a clear 400 invalid that names what is wrong,
// and writes nothing.
func TestGuestConfigBadInputIsRefused(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	good := testAuthorizedKey(t)
	body := func(extra map[string]any) string {
		m := map[string]any{"name": "vm1", "image": "sim", "vcpus": 1, "memory_mib": 512, "disk_mib": 1024}
		for k, v := range extra {
			m[k] = v
		}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	tooManyKeys := make([]string, api.MaxSSHAuthorizedKeys+1)
	for i := range tooManyKeys {
		tooManyKeys[i] = good
	}
	tests := []struct {
		name    string
		extra   map[string]any
		wantMsg string
	}{
		{"user data over 64 KiB", map[string]any{"user_data": strings.Repeat("x", api.MaxUserDataBytes+1)},
			fmt.Sprintf("user_data is %d bytes; the limit is 65536 bytes (64 KiB)", api.MaxUserDataBytes+1)},
		{"malformed key", map[string]any{"ssh_authorized_keys": []string{good, "ssh-ed25519 not-base64!"}},
			"ssh_authorized_keys[1] is not an OpenSSH public key"},
		{"empty key", map[string]any{"ssh_authorized_keys": []string{""}}, "ssh_authorized_keys[0] is not an OpenSSH public key: it is empty"},
		{"two keys in one element", map[string]any{"ssh_authorized_keys": []string{good + "\n" + good}},
			"ssh_authorized_keys[0] is not an OpenSSH public key: it spans several lines"},
		{"too many keys", map[string]any{"ssh_authorized_keys": tooManyKeys}, "ssh_authorized_keys has 33 keys; at most 32"},
		{"meta_data overrides instance-id", map[string]any{"meta_data": map[string]string{"instance-id": "mine"}},
			`meta_data may not set "instance-id": the product sets it`},
		{"meta_data overrides public-keys", map[string]any{"meta_data": map[string]string{"public-keys": "k"}},
			`meta_data may not set "public-keys": the product sets it from ssh_authorized_keys`},
		{"bad local-hostname", map[string]any{"meta_data": map[string]string{"local-hostname": "no_underscores"}},
			`meta_data["local-hostname"]: hostname "no_underscores" is not valid`},
		{"bad meta key", map[string]any{"meta_data": map[string]string{"bad key": "v"}}, `meta_data key "bad key" is not valid`},
		{"network config over 64 KiB", map[string]any{"network_config": "version: 2\n#" + strings.Repeat("x", api.MaxNetworkConfigBytes)},
			"network_config is 65548 bytes; the limit is 65536 bytes"},
		{"network config not YAML", map[string]any{"network_config": "version: [2"},
			"network_config is not a cloud-init network configuration: not a YAML mapping"},
		{"network config without version", map[string]any{"network_config": "ethernets: {}"},
			`network_config is not a cloud-init network configuration: it has neither a top-level "version"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := send(t, c, "POST", "/v1/vms", "Bearer "+c.Token, strings.NewReader(body(tt.extra)), nil)
			if r.status != 400 || r.env.Error.Code != api.CodeInvalid || !strings.Contains(r.env.Error.Message, tt.wantMsg) {
				t.Errorf("got %d %.300s; want 400 invalid with %q", r.status, r.body, tt.wantMsg)
			}
		})
	}
	if vms, err := c.Client.AllVMs(context.Background(), client.ListOptions{}); err != nil || len(vms) != 0 {
		t.Errorf("refused requests wrote VMs: %+v %v", vms, err)
	}
}

// A create with guest configuration answers the configuration back without
// the user data (its digest only), boots cold with a placement note that
// says why, and keeps it for GET.
func TestGuestConfigIsStoredAndNeverReturned(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	ag := testenv.StartAgent(t, testenv.AgentOptions{})
	c.RegisterHost(t, "h1", ag.Address)
	ctx := context.Background()
	key := testAuthorizedKey(t)
	userData := "#cloud-config\nwrite_files:\n- path: /etc/secret\n  content: s3cr3t-value\n"
	in := api.VMCreate{Name: "Web_1", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64, UserData: userData,
		SSHAuthorizedKeys: []string{key}, MetaData: map[string]string{"role": "web"}}
	r := send(t, c, "POST", "/v1/vms", "Bearer "+c.Token, strings.NewReader(mustJSON(t, in)), nil)
	if r.status != 201 {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	if strings.Contains(string(r.body), "s3cr3t-value") {
		t.Fatalf("the create's answer holds the user data: %s", r.body)
	}
	var vm api.VM
	if err := json.Unmarshal(r.body, &vm); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte(userData))
	if vm.UserDataSHA256 != hex.EncodeToString(sum[:]) || vm.Hostname != "web-1" || len(vm.SSHAuthorizedKeys) != 1 ||
		vm.SSHAuthorizedKeys[0] != key || vm.MetaData["role"] != "web" || vm.NetworkConfig != "" {
		t.Errorf("guest fields of the answer: %+v", vm)
	}
	if vm.StartedFrom != api.StartedCold || vm.Placement == nil ||
		!strings.Contains(vm.Placement.Note, "cold: guest configuration needs its own seed at first boot") {
		t.Errorf("started_from %q, placement %+v: want cold with the note", vm.StartedFrom, vm.Placement)
	}
	g := send(t, c, "GET", "/v1/vms/"+vm.ID, "Bearer "+c.Token, nil, nil)
	if g.status != 200 || strings.Contains(string(g.body), "s3cr3t-value") || !strings.Contains(string(g.body), vm.UserDataSHA256) {
		t.Errorf("GET: %d %s", g.status, g.body)
	}
	l := send(t, c, "GET", "/v1/vms", "Bearer "+c.Token, nil, nil)
	if l.status != 200 || strings.Contains(string(l.body), "s3cr3t-value") {
		t.Errorf("list: %d %s", l.status, l.body)
	}
	// The guest routes proxy the agent: the sim reports what the seed holds.
	gs, err := c.Client.VMGuest(ctx, vm.ID)
	if err != nil || gs.CloudInit != api.CloudInitDone || gs.Hostname != "web-1" || gs.UserDataSHA256 != vm.UserDataSHA256 {
		t.Errorf("guest status: %+v %v", gs, err)
	}
	con, err := c.Client.VMConsole(ctx, vm.ID, 0)
	if err != nil || !strings.Contains(con, "kvm-guest-hostname web-1") || !strings.Contains(con, "simulated") {
		t.Errorf("console: %q %v", con, err)
	}
	if tail, err := c.Client.VMConsole(ctx, vm.ID, 10); err != nil || len(tail) != 10 {
		t.Errorf("console tail of 10 bytes: %q %v", tail, err)
	}
	for path, code := range map[string]int{"/v1/vms/nope/guest": 404, "/v1/vms/nope/console": 404,
		"/v1/vms/" + vm.ID + "/console?bytes=0": 400, "/v1/vms/" + vm.ID + "/console?bytes=2000000": 400} {
		if r := send(t, c, "GET", path, "Bearer "+c.Token, nil, nil); r.status != code {
			t.Errorf("GET %s: %d %s, want %d", path, r.status, r.body, code)
		}
	}
	// A fork child is a new instance: its own hostname (from its name),
	// the same user data; restored, it has not read its seed yet, and
	// does at its next boot.
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: vm.ID, Count: 1}, "")
	if err != nil || len(f.Children) != 1 {
		t.Fatalf("fork: %+v %v", f, err)
	}
	child := f.Children[0]
	wantHost := strings.ToLower(child.Name)
	if child.Hostname != wantHost || child.UserDataSHA256 != vm.UserDataSHA256 || child.MetaData["role"] != "web" ||
		len(child.SSHAuthorizedKeys) != 1 {
		t.Errorf("child: %+v, want hostname %s and the source's configuration", child, wantHost)
	}
	if gs, err := c.Client.VMGuest(ctx, child.ID); err != nil || gs.CloudInit != api.CloudInitNone {
		t.Errorf("restored child: %+v %v, want none", gs, err)
	}
	stopped := api.PowerStopped
	if _, err := c.Client.UpdateVM(ctx, child.ID, api.VMPatch{PowerState: &stopped}); err != nil {
		t.Fatal(err)
	}
	running := api.PowerRunning
	if _, err := c.Client.UpdateVM(ctx, child.ID, api.VMPatch{PowerState: &running}); err != nil {
		t.Fatal(err)
	}
	if gs, err := c.Client.VMGuest(ctx, child.ID); err != nil || gs.CloudInit != api.CloudInitDone ||
		gs.Hostname != wantHost || gs.UserDataSHA256 != vm.UserDataSHA256 {
		t.Errorf("child after its next boot: %+v %v, want done as %s", gs, err, wantHost)
	}
	// A local-hostname given in meta_data is the hostname.
	named, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "n2", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64,
		MetaData: map[string]string{"local-hostname": "db.example.test"}}, "")
	if err != nil || named.Hostname != "db.example.test" || named.UserDataSHA256 != "" {
		t.Errorf("meta_data local-hostname: %+v %v", named, err)
	}
	// A VM without guest configuration has empty fields, not nulls.
	plain := send(t, c, "POST", "/v1/vms", "Bearer "+c.Token,
		strings.NewReader(`{"name":"plain","image":"sim","vcpus":1,"memory_mib":64,"disk_mib":64}`), nil)
	if plain.status != 201 || !strings.Contains(string(plain.body), `"ssh_authorized_keys":[]`) ||
		!strings.Contains(string(plain.body), `"meta_data":{}`) || !strings.Contains(string(plain.body), `"user_data_sha256":""`) {
		t.Errorf("plain VM: %d %s", plain.status, plain.body)
	}
	// The host does not answer: both routes say so with 503.
	ag.Stop()
	for _, path := range []string{"/v1/vms/" + vm.ID + "/guest", "/v1/vms/" + vm.ID + "/console"} {
		if r := send(t, c, "GET", path, "Bearer "+c.Token, nil, nil); r.status != 503 || r.env.Error.Code != api.CodeUnavailable {
			t.Errorf("GET %s with its host down: %d %s, want 503 unavailable", path, r.status, r.body)
		} else {
			t.Logf("GET %s with its host down: %s", path, r.body)
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
