package qemu_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// hostilePeer serves snapshots made of files the test crafted, the way an
// agent serves them (metadata and files), to see what a pulling agent
// accepts. It is a peer the control plane vouches for (its key is pinned):
// a compromised host, not an impostor.
type hostilePeer struct {
	dir  string
	snap map[string]agentapi.Snapshot
	srv  *httptest.Server
	key  ed25519.PrivateKey
}

func startHostilePeer(t *testing.T) *hostilePeer {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	p := &hostilePeer{dir: t.TempDir(), snap: map[string]agentapi.Snapshot{}, key: key}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/identity" {
			var ch agentapi.IdentityChallenge
			_ = json.NewDecoder(r.Body).Decode(&ch)
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(agentapi.ProveIdentity(key, "agent-token", ch))
			return
		}
		rest, ok := strings.CutPrefix(r.URL.Path, "/v1/snapshots/")
		if !ok {
			http.NotFound(w, r)
			return
		}
		id, file, isFile := strings.Cut(rest, "/files/")
		s, ok := p.snap[id]
		if !ok {
			http.NotFound(w, r)
			return
		}
		if isFile {
			http.ServeFile(w, r, filepath.Join(p.dir, id, file))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// add offers snapshot id of a busybox guest whose frozen disk is disk
// (a qcow2 file the test made) and whose memory state is junk.
func (p *hostilePeer) add(t *testing.T, id, disk string) {
	t.Helper()
	dir := filepath.Join(p.dir, id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "memory.state"), []byte("not a migration stream"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(disk, filepath.Join(dir, "disk.qcow2")); err != nil {
		t.Fatal(err)
	}
	s := agentapi.Snapshot{ID: id, VMID: "src", Image: guest.Image, VCPUs: guest.VCPUs, MemoryMiB: guest.MemoryMiB,
		DiskMiB: guest.DiskMiB, CreatedAt: time.Now().UTC()}
	for _, f := range []struct{ name, kind string }{{"memory.state", agentapi.SnapshotFileMemory}, {"disk.qcow2", agentapi.SnapshotFileDisk}} {
		b, err := os.ReadFile(filepath.Join(dir, f.name))
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		s.Files = append(s.Files, agentapi.SnapshotFile{Name: f.name, Kind: f.kind, SizeBytes: int64(len(b)), SHA256: hex.EncodeToString(sum[:])})
	}
	p.snap[id] = s
}

// source is how the control plane names snapshot id on this peer.
func (p *hostilePeer) source(id string) *agentapi.SnapshotSource {
	pub, _ := p.key.Public().(ed25519.PublicKey)
	return &agentapi.SnapshotSource{ID: id, Address: p.srv.URL, PublicKey: agentapi.EncodeKey(pub)}
}

func qemuImg(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img %v: %v: %s", args, err, out)
	}
}

func backingOf(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "-U", "--output=json", path).Output()
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", path, err)
	}
	var info struct {
		Backing string `json:"backing-filename"`
	}
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatal(err)
	}
	return info.Backing
}

// Finding 2: a pulled snapshot whose frozen disk names a backing file
// outside the pulling agent's own files is refused before anything opens
// it: no snapshot is kept, no VM and no QEMU process is left. A disk that
// names its image's base disk where the other agent keeps it is rewritten
// to this agent's own base disk.
func TestPulledSnapshotWithHostileBackingChainIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// The guest image, with a base disk (a kernel image may have one): a
	// frozen disk's chain ends on it.
	imageDir := t.TempDir()
	img := filepath.Join(imageDir, guest.Image)
	if err := os.MkdirAll(img, 0o755); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(testenv.GuestImageDir(t), guest.Image)
	var manifest map[string]any
	b, err := os.ReadFile(filepath.Join(src, "image.json"))
	if err != nil || json.Unmarshal(b, &manifest) != nil {
		t.Fatalf("read the guest image's manifest: %v", err)
	}
	for _, k := range []string{"kernel", "initrd"} {
		if name, _ := manifest[k].(string); name != "" {
			if err := os.Symlink(filepath.Join(src, name), filepath.Join(img, name)); err != nil {
				t.Fatal(err)
			}
		}
	}
	manifest["disk"] = "disk.qcow2"
	if b, err = json.Marshal(manifest); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(img, "image.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(img, "disk.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", base, "32M")
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: imageDir})
	peer := startHostilePeer(t)
	secret := filepath.Join(t.TempDir(), "secret.txt")
	if err := os.WriteFile(secret, []byte("host secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	size := "64M"
	hostile := map[string][]string{
		"absolute":     {"-b", secret, "-F", "raw"},
		"relative":     {"-b", "../../../../../../../../.." + secret, "-F", "raw"},
		"json":         {"-b", `json:{"driver":"raw","file":{"driver":"file","filename":"` + secret + `"}}`, "-F", "raw"},
		"parent-ghost": {"-b", "../../snapshots/nope/disk.qcow2", "-F", "qcow2"},
		"self":         {"-b", "disk.qcow2", "-F", "qcow2"},
		"data-file":    {"-o", "data_file=" + filepath.Join(work, "data-file.raw")},
	}
	for name, opts := range hostile {
		disk := filepath.Join(work, name+".qcow2")
		args := append([]string{"create", "-q", "-f", "qcow2", "-u"}, opts...)
		qemuImg(t, append(args, disk, size)...)
		peer.add(t, "evil-"+name, disk)
	}
	for name := range hostile {
		id := "evil-" + name
		spec := guest
		spec.Snapshot = peer.source(id)
		_, err := a.Client.CreateVM(ctx, "child-"+name, spec)
		if err == nil || !strings.Contains(err.Error(), "refused") {
			t.Errorf("%s: child from a hostile chain: %v; want the pull refused", name, err)
		}
		if _, err := a.Client.GetSnapshot(ctx, id); err == nil {
			t.Errorf("%s: the hostile snapshot was kept", name)
		}
	}
	if entries, _ := os.ReadDir(filepath.Join(a.StateDir, "snapshots")); len(entries) != 0 {
		t.Errorf("hostile pulls left %v in the snapshots directory", entries)
	}
	if entries, _ := os.ReadDir(filepath.Join(a.StateDir, "vms")); len(entries) != 0 {
		t.Errorf("hostile pulls left VMs %v", entries)
	}

	// The other agent's base disk path is its own: rewritten to ours.
	disk := filepath.Join(work, "base.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", "-u", "-b", "/srv/other-agent/images/"+guest.Image+"/disk.qcow2", "-F", "qcow2", disk, size)
	peer.add(t, "elsewhere", disk)
	spec := guest
	spec.Snapshot = peer.source("elsewhere")
	_, _ = a.Client.CreateVM(ctx, "child-elsewhere", spec) // its memory state is junk: the child fails to load it
	snap, err := a.Client.GetSnapshot(ctx, "elsewhere")
	if err != nil {
		t.Fatalf("a snapshot on the image's base disk was not kept: %v", err)
	}
	pulled := filepath.Join(a.StateDir, "snapshots", "elsewhere", "disk.qcow2")
	if got := backingOf(t, pulled); got != base {
		t.Errorf("pulled disk's backing file %q, want this agent's base disk %q", got, base)
	}
	b, err = os.ReadFile(pulled)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	for _, f := range snap.Files {
		if f.Name == "disk.qcow2" && f.SHA256 != hex.EncodeToString(sum[:]) {
			t.Errorf("the rewritten disk's recorded sha256 %s is not its content's", f.SHA256)
		}
	}
}
