package image_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// fastFetch keeps retries short in tests.
var fastFetch = image.Config{Backoff: 20 * time.Millisecond, Attempts: 4}

// imageFiles makes a served folder with a real qcow2 image and a raw file.
func imageFiles(t *testing.T) (dir, qcowSHA, rawSHA string) {
	t.Helper()
	dir = t.TempDir()
	q := testenv.WriteQCOW2(t, dir, "tiny.qcow2", 64)
	raw := make([]byte, 3<<20)
	if _, err := rand.Read(raw); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "blob.raw"), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir, testenv.FileSHA256(t, q), testenv.FileSHA256(t, filepath.Join(dir, "blob.raw"))
}

func vmSpec(src agentapi.ImageSource) agentapi.VMSpec {
	return agentapi.VMSpec{Image: src.Name, VCPUs: 1, MemoryMiB: 128, DiskMiB: 128, ImageSource: &src}
}

func cacheEntries(t *testing.T, cacheDir string) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(cacheDir, "sha256"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

// peerOf is agent a as the control plane names it to another agent: its
// address and pinned identity key.
func peerOf(a *testenv.Agent) agentapi.ImagePeer {
	return agentapi.ImagePeer{Address: a.Address, PublicKey: agentapi.EncodeKey(a.PublicKey)}
}

func imageStatus(t *testing.T, a *testenv.Agent, sha string) agentapi.ImageStatus {
	t.Helper()
	items, err := a.Client.Images(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range items {
		if it.SHA256 == sha {
			return it
		}
	}
	return agentapi.ImageStatus{}
}

// The first VM on a host fetches the image from the source; a second VM on
// that host does not fetch again; a VM on another host pulls it from the
// first host: one download from the source in all.
func TestFetchOnceThenPeer(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	b := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	ctx := context.Background()
	src := agentapi.ImageSource{Name: "tiny", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2"}

	vm, err := a.Client.CreateVM(ctx, "vm-1", vmSpec(src))
	if err != nil {
		t.Fatalf("first create: %v", err)
	}
	if vm.State != agentapi.StateRunning || vm.Image != image.Ref(qcowSHA) {
		t.Fatalf("first vm: %+v", vm)
	}
	if _, err := a.Client.CreateVM(ctx, "vm-2", vmSpec(src)); err != nil {
		t.Fatalf("second create: %v", err)
	}
	if n := srv.Downloads(); n != 1 {
		t.Fatalf("downloads after two vms on one host = %d, want 1", n)
	}
	st := imageStatus(t, a, qcowSHA)
	if st.Status != agentapi.ImageReady || st.VirtualSizeMiB != 64 || st.SizeBytes == 0 || st.From != srv.FileURL("tiny.qcow2") {
		t.Fatalf("status on host a: %+v", st)
	}

	peered := src
	peered.Peers = []agentapi.ImagePeer{peerOf(a)}
	if _, err := b.Client.CreateVM(ctx, "vm-3", vmSpec(peered)); err != nil {
		t.Fatalf("create on host b: %v", err)
	}
	if n := srv.Downloads(); n != 1 {
		t.Fatalf("downloads after a vm on the second host = %d, want 1 (pulled from the peer)", n)
	}
	st = imageStatus(t, b, qcowSHA)
	if st.Status != agentapi.ImageReady || st.From != "peer "+a.Address {
		t.Fatalf("status on host b: %+v", st)
	}
	got := testenv.FileSHA256(t, filepath.Join(b.CacheDir(), "sha256", qcowSHA, "disk.qcow2"))
	if got != qcowSHA {
		t.Fatalf("host b's copy has sha256 %s, want %s", got, qcowSHA)
	}
}

// A wrong sha256: failed on that host with both digests, no file left, no VM.
func TestWrongDigest(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	wrong := strings.Repeat("ab", 32)
	src := agentapi.ImageSource{Name: "tiny", SHA256: wrong, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2"}
	_, err := a.Client.CreateVM(context.Background(), "vm-1", vmSpec(src))
	if !errors.Is(err, agentapi.ErrInvalid) || !strings.Contains(err.Error(), wrong) || !strings.Contains(err.Error(), qcowSHA) {
		t.Fatalf("create with a wrong sha256: %v; want a 4xx naming %s and %s", err, wrong, qcowSHA)
	}
	st := imageStatus(t, a, wrong)
	if st.Status != agentapi.ImageFailed || !strings.Contains(st.Reason, "expected "+wrong+", got "+qcowSHA) {
		t.Fatalf("status: %+v", st)
	}
	if left := cacheEntries(t, a.CacheDir()); len(left) != 0 {
		t.Fatalf("files left in the cache: %v", left)
	}
	if vms, err := a.Client.ListVMs(context.Background()); err != nil || len(vms) != 0 {
		t.Fatalf("vms after a failed image: %v %v", vms, err)
	}
	if n := srv.Downloads(); n != 1 {
		t.Fatalf("downloads = %d: a wrong digest is not retried", n)
	}
}

// A server that drops the connection mid-stream: the fetch resumes with a
// Range request and the finished file verifies.
func TestDroppedConnectionResumes(t *testing.T) {
	dir, _, rawSHA := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	srv.DropNextAfter(1 << 20)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	src := agentapi.ImageSource{Name: "blob", SHA256: rawSHA, SourceURL: srv.FileURL("blob.raw"), Format: "raw"}
	if _, err := a.Client.CreateVM(context.Background(), "vm-1", vmSpec(src)); err != nil {
		t.Fatalf("create: %v", err)
	}
	if srv.Requests() != 2 || srv.Downloads() != 1 {
		t.Fatalf("requests %d, full downloads %d: want a first GET cut and one ranged GET", srv.Requests(), srv.Downloads())
	}
	if got := srv.BytesServed(); got != 3<<20 {
		t.Fatalf("bytes served %d, want %d (the rest only, not the whole again)", got, 3<<20)
	}
	got := testenv.FileSHA256(t, filepath.Join(a.CacheDir(), "sha256", rawSHA, "disk.raw"))
	if got != rawSHA {
		t.Fatalf("cached file sha256 %s, want %s", got, rawSHA)
	}
	if left := cacheEntries(t, a.CacheDir()); len(left) != 1 || left[0] != rawSHA {
		t.Fatalf("cache holds %v, want only %s", left, rawSHA)
	}
}

// Ten concurrent creates that need the same new image on one host: one fetch.
func TestConcurrentCreatesOneFetch(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	srv.Delay(300 * time.Millisecond)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	src := agentapi.ImageSource{Name: "tiny", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2"}
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := a.Client.CreateVM(context.Background(), fmt.Sprintf("vm-%d", i), vmSpec(src))
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := srv.Requests(); n != 1 {
		t.Fatalf("requests to the source = %d, want 1", n)
	}
	if vms, _ := a.Client.ListVMs(context.Background()); len(vms) != 10 {
		t.Fatalf("%d vms, want 10", len(vms))
	}
}

// A declared format that does not match the bytes: failed with the reason,
// nothing cached.
func TestFormatMismatch(t *testing.T) {
	dir, qcowSHA, rawSHA := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	for _, c := range []struct {
		src  agentapi.ImageSource
		want string
	}{
		{agentapi.ImageSource{Name: "raw-as-qcow2", SHA256: rawSHA, SourceURL: srv.FileURL("blob.raw"), Format: "qcow2"}, "is not a qcow2 file"},
		{agentapi.ImageSource{Name: "qcow2-as-raw", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "raw"}, "is a qcow2 file but format raw"},
		{agentapi.ImageSource{Name: "raw-as-kernel", SHA256: rawSHA, SourceURL: srv.FileURL("blob.raw"), Format: "kernel"}, "is not a kernel bundle"},
	} {
		_, err := a.Client.CreateVM(context.Background(), "vm-"+c.src.Name, vmSpec(c.src))
		if !errors.Is(err, agentapi.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want a 4xx saying %q", c.src.Name, err, c.want)
		}
		if st := imageStatus(t, a, c.src.SHA256); st.Status != agentapi.ImageFailed || !strings.Contains(st.Reason, c.want) {
			t.Errorf("%s: status %+v", c.src.Name, st)
		}
		if left := cacheEntries(t, a.CacheDir()); len(left) != 0 {
			t.Errorf("%s: cache holds %v", c.src.Name, left)
		}
	}
}

// A source the cache cannot take: a clear 400 before anything is fetched.
func TestBadSource(t *testing.T) {
	a := testenv.StartAgent(t, testenv.AgentOptions{})
	good := strings.Repeat("0", 64)
	for _, c := range []struct {
		src  agentapi.ImageSource
		want string
	}{
		{agentapi.ImageSource{Name: "x", SHA256: good, SourceURL: "ftp://127.0.0.1/x", Format: "qcow2"}, "want an http, https or file:// URL"},
		{agentapi.ImageSource{Name: "x", SHA256: "abc", SourceURL: "http://127.0.0.1/x", Format: "qcow2"}, "is not 64 lower-case hex digits"},
		{agentapi.ImageSource{Name: "x", SHA256: good, SourceURL: "http://127.0.0.1/x", Format: "vmdk"}, "want qcow2, raw or kernel"},
	} {
		_, err := a.Client.CreateVM(context.Background(), "vm-1", vmSpec(c.src))
		var ae *agentapi.Error
		if !errors.As(err, &ae) || ae.Status != 400 || !strings.Contains(ae.Message, c.want) {
			t.Errorf("%+v: %v; want 400 saying %q", c.src, err, c.want)
		}
	}
	if left := cacheEntries(t, a.CacheDir()); len(left) != 0 {
		t.Fatalf("cache holds %v", left)
	}
}

// An image no VM uses can be removed; one in use cannot (409 naming the VM).
func TestRemoveImage(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	a := testenv.StartAgent(t, testenv.AgentOptions{})
	ctx := context.Background()
	src := agentapi.ImageSource{Name: "tiny", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2"}
	if _, err := a.Client.CreateVM(ctx, "vm-1", vmSpec(src)); err != nil {
		t.Fatal(err)
	}
	if err := a.Client.DeleteImage(ctx, qcowSHA); !errors.Is(err, agentapi.ErrConflict) || !strings.Contains(err.Error(), "vm vm-1") {
		t.Fatalf("delete in use: %v", err)
	}
	if err := a.Client.DeleteVM(ctx, "vm-1"); err != nil {
		t.Fatal(err)
	}
	if err := a.Client.DeleteImage(ctx, qcowSHA); err != nil {
		t.Fatalf("delete unused: %v", err)
	}
	if left := cacheEntries(t, a.CacheDir()); len(left) != 0 {
		t.Fatalf("cache holds %v after delete", left)
	}
	if err := a.Client.DeleteImage(ctx, qcowSHA); err != nil {
		t.Fatalf("delete again: %v", err)
	}
}

// Prefetch starts the fetch at once; the image is kept across an agent
// restart.
func TestPrefetchAndRestart(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	a := testenv.StartAgent(t, testenv.AgentOptions{})
	ctx := context.Background()
	src := agentapi.ImageSource{Name: "tiny", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2"}
	if _, err := a.Client.PrefetchImage(ctx, src); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for imageStatus(t, a, qcowSHA).Status != agentapi.ImageReady {
		if time.Now().After(deadline) {
			t.Fatalf("prefetch not ready: %+v", imageStatus(t, a, qcowSHA))
		}
		time.Sleep(20 * time.Millisecond)
	}
	a.Restart(t)
	if st := imageStatus(t, a, qcowSHA); st.Status != agentapi.ImageReady || st.VirtualSizeMiB != 64 {
		t.Fatalf("after restart: %+v", st)
	}
	if _, err := a.Client.CreateVM(ctx, "vm-1", vmSpec(src)); err != nil {
		t.Fatal(err)
	}
	if n := srv.Downloads(); n != 1 {
		t.Fatalf("downloads = %d, want 1", n)
	}
}

// A full disk is a clear error and leaves no partial file (a small tmpfs
// as the cache; needs root to mount it).
func TestDiskFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a small tmpfs needs root")
	}
	dir, _, rawSHA := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	cache := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", cache).CombinedOutput(); err != nil {
		t.Skipf("mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", cache).Run() })
	a := testenv.StartAgent(t, testenv.AgentOptions{CacheDir: cache, ImageFetch: fastFetch})
	src := agentapi.ImageSource{Name: "blob", SHA256: rawSHA, SourceURL: srv.FileURL("blob.raw"), Format: "raw"}
	_, err := a.Client.CreateVM(context.Background(), "vm-1", vmSpec(src))
	if err == nil || !strings.Contains(err.Error(), "free space there") {
		t.Fatalf("create with a full cache: %v", err)
	}
	if left := cacheEntries(t, cache); len(left) != 0 {
		t.Fatalf("cache holds %v", left)
	}
	// A file:// source on the host is refused the same way.
	src.SourceURL = "file://" + filepath.Join(dir, "blob.raw")
	_, err = a.Client.CreateVM(context.Background(), "vm-2", vmSpec(src))
	if err == nil || !strings.Contains(err.Error(), "free space there") {
		t.Fatalf("create from file:// with a full cache: %v", err)
	}
	if left := cacheEntries(t, cache); len(left) != 0 {
		t.Fatalf("cache holds %v", left)
	}
}

// A peer that is down, or that serves other bytes, is skipped: the image
// comes from the source and verifies.
func TestBadPeerFallsBackToSource(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	liar := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("QFI\xfb but not the image you asked for"))
	}))
	t.Cleanup(liar.Close)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	key := agentapi.EncodeKey(a.PublicKey) // keys no peer here holds
	src := agentapi.ImageSource{Name: "tiny", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2",
		Peers: []agentapi.ImagePeer{{Address: "http://127.0.0.1:1", PublicKey: key}, {Address: liar.URL, PublicKey: key}}}
	if _, err := a.Client.CreateVM(context.Background(), "vm-1", vmSpec(src)); err != nil {
		t.Fatal(err)
	}
	st := imageStatus(t, a, qcowSHA)
	if st.Status != agentapi.ImageReady || st.From != srv.FileURL("tiny.qcow2") || srv.Downloads() != 1 {
		t.Fatalf("status %+v, downloads %d", st, srv.Downloads())
	}
}

// A fetch cut by an agent restart keeps its partial file; the next fetch
// asks only for the rest (Range), and the result verifies.
func TestFetchResumesAfterRestart(t *testing.T) {
	dir, _, rawSHA := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	srv.Slow(20 * time.Millisecond) // 3 MiB in about a second
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	ctx := context.Background()
	src := agentapi.ImageSource{Name: "blob", SHA256: rawSHA, SourceURL: srv.FileURL("blob.raw"), Format: "raw"}
	if _, err := a.Client.PrefetchImage(ctx, src); err != nil {
		t.Fatal(err)
	}
	partial := filepath.Join(a.CacheDir(), "sha256", ".partial-"+rawSHA)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if fi, err := os.Stat(partial); err == nil && fi.Size() >= 512<<10 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the fetch never wrote 512 KiB")
		}
		time.Sleep(10 * time.Millisecond)
	}
	a.Restart(t)
	fi, err := os.Stat(partial)
	if err != nil || fi.Size() == 0 || fi.Size() >= 3<<20 {
		t.Fatalf("partial file after the restart: %v %v", fi, err)
	}
	srv.Slow(0)
	if _, err := a.Client.CreateVM(ctx, "vm-1", vmSpec(src)); err != nil {
		t.Fatal(err)
	}
	if srv.Downloads() != 1 || srv.Requests() != 2 {
		t.Fatalf("full downloads %d, requests %d: want one from the start and one ranged", srv.Downloads(), srv.Requests())
	}
	if got := testenv.FileSHA256(t, filepath.Join(a.CacheDir(), "sha256", rawSHA, "disk.raw")); got != rawSHA {
		t.Fatalf("sha256 %s, want %s", got, rawSHA)
	}
	if _, err := os.Stat(partial); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("partial file left: %v", err)
	}
}

// A peer that does not prove the identity key the control plane pinned for
// it never sees the agent's token, and its bytes are not used: an impostor
// at the address (any server answering there), and a real agent named with
// another agent's key, are skipped for the source. A peer with no key or a
// bad address is refused up front (400), nothing fetched.
func TestPeerMustProveItsPinnedKey(t *testing.T) {
	dir, qcowSHA, _ := imageFiles(t)
	srv := testenv.StartImageServer(t, dir)
	blob, err := os.ReadFile(filepath.Join(dir, "tiny.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []string // Authorization headers the impostor got
	impostor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+" auth="+r.Header.Get("Authorization"))
		mu.Unlock()
		if strings.HasSuffix(r.URL.Path, "/blob") {
			_, _ = w.Write(blob) // the right bytes: only the key can tell
			return
		}
		http.Error(w, "no identity here", http.StatusNotFound)
	}))
	t.Cleanup(impostor.Close)
	holder := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	other := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	ctx := context.Background()
	src := agentapi.ImageSource{Name: "tiny", SHA256: qcowSHA, SourceURL: srv.FileURL("tiny.qcow2"), Format: "qcow2"}
	if _, err := holder.Client.CreateVM(ctx, "vm-0", vmSpec(src)); err != nil {
		t.Fatal(err)
	}
	if srv.Downloads() != 1 {
		t.Fatalf("downloads = %d, want 1", srv.Downloads())
	}

	peered := src
	peered.Peers = []agentapi.ImagePeer{
		{Address: impostor.URL, PublicKey: agentapi.EncodeKey(holder.PublicKey)},
		{Address: holder.Address, PublicKey: agentapi.EncodeKey(other.PublicKey)},
	}
	if _, err := a.Client.CreateVM(ctx, "vm-1", vmSpec(peered)); err != nil {
		t.Fatal(err)
	}
	st := imageStatus(t, a, qcowSHA)
	if st.Status != agentapi.ImageReady || st.From != srv.FileURL("tiny.qcow2") || srv.Downloads() != 2 {
		t.Fatalf("status %+v, downloads %d: want the source, not an unproven peer", st, srv.Downloads())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) == 0 {
		t.Fatal("the impostor was never challenged: the test proves nothing")
	}
	for _, r := range seen {
		if strings.Contains(r, "/blob") || !strings.HasSuffix(r, "auth=") {
			t.Fatalf("the impostor got %q: only a token-less identity challenge may go to an unproven peer", r)
		}
	}

	for _, bad := range []agentapi.ImagePeer{
		{Address: holder.Address},
		{Address: strings.TrimPrefix(holder.Address, "http://"), PublicKey: agentapi.EncodeKey(holder.PublicKey)},
	} {
		spec := src
		spec.SHA256, spec.Peers = strings.Repeat("cd", 32), []agentapi.ImagePeer{bad}
		_, err := a.Client.PrefetchImage(ctx, spec)
		if !errors.Is(err, agentapi.ErrInvalid) || !strings.Contains(err.Error(), "peers[0]") {
			t.Fatalf("prefetch with peer %+v: %v; want a 400 naming peers[0]", bad, err)
		}
	}
	if srv.Downloads() != 2 {
		t.Fatalf("downloads = %d after refused prefetches, want 2", srv.Downloads())
	}
}

// A registered qcow2 image must be one self-contained file: one that names
// a backing file (a path of the host, opened by QEMU under the VM's disk)
// or an external data file is failed with the reason, and so is a qcow2
// file declared raw whatever its header holds; an empty raw file is raw.
func TestImageThatIsNotSelfContainedIsRefused(t *testing.T) {
	testenv.RequireQEMU(t)
	dir := t.TempDir()
	for name, args := range map[string][]string{
		"backed.qcow2":   {"create", "-q", "-f", "qcow2", "-u", "-b", "/etc/hostname", "-F", "raw", "FILE", "64M"},
		"datafile.qcow2": {"create", "-q", "-f", "qcow2", "-o", "data_file=" + filepath.Join(dir, "data.raw"), "FILE", "64M"},
	} {
		for i, a := range args {
			if a == "FILE" {
				args[i] = filepath.Join(dir, name)
			}
		}
		if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %v: %v: %s", args, err, out)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "empty.raw"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	srv := testenv.StartImageServer(t, dir)
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})
	source := func(file, format string) agentapi.ImageSource {
		return agentapi.ImageSource{Name: strings.ReplaceAll(file, ".", "-") + "-" + format,
			SHA256: testenv.FileSHA256(t, filepath.Join(dir, file)), SourceURL: srv.FileURL(file), Format: format}
	}
	for _, c := range []struct {
		src  agentapi.ImageSource
		want string
	}{
		{source("backed.qcow2", "qcow2"), `names a backing file ("/etc/hostname")`},
		{source("datafile.qcow2", "qcow2"), "external data file"},
		{source("backed.qcow2", "raw"), "is a qcow2 file but format raw"},
	} {
		_, err := a.Client.CreateVM(context.Background(), "vm-"+c.src.Name, vmSpec(c.src))
		if !errors.Is(err, agentapi.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want a 4xx saying %q", c.src.Name, err, c.want)
		}
		if st := imageStatus(t, a, c.src.SHA256); st.Status != agentapi.ImageFailed || !strings.Contains(st.Reason, c.want) {
			t.Errorf("%s: status %+v", c.src.Name, st)
		}
	}
	empty := source("empty.raw", "raw")
	if _, err := a.Client.CreateVM(context.Background(), "vm-empty", vmSpec(empty)); err != nil {
		t.Errorf("a VM on an empty raw image: %v", err)
	}
	if st := imageStatus(t, a, empty.SHA256); st.Status != agentapi.ImageReady {
		t.Errorf("an empty raw image: status %+v, want ready", st)
	}
}
