package image_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// serveAt serves h on addr (ip:0) until the test ends and returns its
// http:// URL.
func serveAt(t *testing.T, addr string, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String()
}

// redirectTo answers every request with a redirect to target and counts
// the requests.
func redirectTo(target string, n *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		http.Redirect(w, r, target, http.StatusFound)
	})
}

// addLink adds an interface with addresses to the test's own network
// namespace (a bridge without ports: the dummy module may be missing).
func addLink(t *testing.T, name string, cidrs ...string) {
	t.Helper()
	link := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
	if err := netlink.LinkAdd(link); err != nil {
		t.Fatal(err)
	}
	for _, c := range cidrs {
		addr, err := netlink.ParseAddr(c)
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.AddrAdd(link, addr); err != nil {
			t.Fatal(err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		t.Fatal(err)
	}
}

// failedWith fetches src through a VM create and returns the image's
// failed status, failing the test when the image did not fail.
func failedWith(t *testing.T, a *testenv.Agent, src agentapi.ImageSource) agentapi.ImageStatus {
	t.Helper()
	if _, err := a.Client.CreateVM(context.Background(), "vm-"+src.Name, vmSpec(src)); err == nil {
		t.Fatalf("%s: a VM was made of the image", src.Name)
	}
	st := imageStatus(t, a, src.SHA256)
	if st.Status != agentapi.ImageFailed {
		t.Fatalf("%s: status %+v, want failed", src.Name, st)
	}
	t.Logf("%s: failed: %s", src.Name, st.Reason)
	return st
}

// A source may not lead the agent to its own host's services or to
// link-local ones: a registration URL on an ordinary address of the host
// (198.51.100.1, in the test's own network namespace) that redirects to
// 127.0.0.1 is refused at connect time, as is one on 127.0.0.1 that
// redirects to a link-local address; the server behind the redirect never
// gets a request. A source on 127.0.0.1 may still redirect within
// loopback, a redirect to file:// is refused, and a redirect loop is cut
// after 5 redirects, without retries.
func TestRedirectsCannotReachGuardedAddresses(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	addLink(t, "kvmsrc0", "198.51.100.1/24", "169.254.10.1/16")
	dir, qcowSHA, _ := imageFiles(t)
	inner := testenv.StartImageServer(t, dir) // on 127.0.0.1
	var hops, linkLocalHits, loops atomic.Int64
	outside := serveAt(t, "198.51.100.1:0", redirectTo(inner.FileURL("tiny.qcow2"), &hops))
	linkLocal := serveAt(t, "169.254.10.1:0", redirectTo(inner.FileURL("tiny.qcow2"), &linkLocalHits))
	toLinkLocal := serveAt(t, "127.0.0.1:0", redirectTo(linkLocal+"/tiny.qcow2", &hops))
	toFile := serveAt(t, "127.0.0.1:0", redirectTo("file://"+filepath.Join(dir, "tiny.qcow2"), &hops))
	loop := serveAt(t, "127.0.0.1:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := loops.Add(1)
		http.Redirect(w, r, fmt.Sprintf("/again-%d", n), http.StatusFound)
	}))
	within := serveAt(t, "127.0.0.1:0", redirectTo(inner.FileURL("tiny.qcow2"), &hops))
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fastFetch})

	for i, c := range []struct{ url, want string }{
		{outside + "/tiny.qcow2", "connect to 127.0.0.1:"},
		{toLinkLocal + "/tiny.qcow2", "connect to 169.254.10.1:"},
		{toFile + "/tiny.qcow2", `redirect refused: a redirect to a "file" URL`},
		{loop + "/start", "redirect refused: more than 5 redirects"},
	} {
		src := agentapi.ImageSource{Name: fmt.Sprintf("case-%d", i), SHA256: strings.Repeat(fmt.Sprintf("%x", i+1), 64),
			SourceURL: c.url, Format: "qcow2"}
		st := failedWith(t, a, src)
		if !strings.Contains(st.Reason, c.want) || !strings.Contains(st.Reason, "GET "+c.url+": ") {
			t.Errorf("%s: reason %q, want %q", c.url, st.Reason, c.want)
		}
	}
	if n := inner.Requests(); n != 0 {
		t.Errorf("the loopback server behind the redirects got %d requests, want 0", n)
	}
	if n := linkLocalHits.Load(); n != 0 {
		t.Errorf("the link-local server got %d requests, want 0", n)
	}
	if n := loops.Load(); n != 6 {
		t.Errorf("the redirect loop was asked %d times, want 6 (the URL and 5 redirects, no retry)", n)
	}
	src := agentapi.ImageSource{Name: "within", SHA256: qcowSHA, SourceURL: within + "/tiny.qcow2", Format: "qcow2"}
	if _, err := a.Client.CreateVM(context.Background(), "vm-within", vmSpec(src)); err != nil {
		t.Fatalf("a source on 127.0.0.1 redirecting within loopback: %v", err)
	}
}

// endless answers 200 with a chunked body that does not end (until the
// client goes or limit bytes are written) and counts what it wrote.
func endless(wrote *atomic.Int64, limit int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		buf := make([]byte, 64<<10)
		for wrote.Load() < limit {
			n, err := w.Write(buf)
			wrote.Add(int64(n))
			if err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	})
}

// The agent's size cap: a Content-Length above it is refused before the
// body is read, and a chunked answer that never ends is cut at the cap;
// either way the image fails with a reason that names the cap and how to
// raise it, and no partial file stays.
func TestSourceCutAtSizeCap(t *testing.T) {
	dir, _, rawSHA := imageFiles(t) // blob.raw: 3 MiB
	srv := testenv.StartImageServer(t, dir)
	var wrote atomic.Int64
	stream := serveAt(t, "127.0.0.1:0", endless(&wrote, 256<<20))
	fetch := fastFetch
	fetch.MaxBytes = 1 << 20
	a := testenv.StartAgent(t, testenv.AgentOptions{ImageFetch: fetch})
	hint := "larger than this agent's cap of 1048576 bytes"
	raise := "raise the cap with kvmd agent --image-max-bytes (KVMD_IMAGE_MAX_BYTES)"

	big := agentapi.ImageSource{Name: "big", SHA256: rawSHA, SourceURL: srv.FileURL("blob.raw"), Format: "raw"}
	st := failedWith(t, a, big)
	if !strings.Contains(st.Reason, hint+" (its size is 3145728 bytes)") || !strings.Contains(st.Reason, raise) {
		t.Errorf("a 3 MiB Content-Length: reason %q", st.Reason)
	}
	if n := srv.Requests(); n != 1 {
		t.Errorf("the source got %d requests, want 1: a size over the cap is not retried", n)
	}

	never := agentapi.ImageSource{Name: "never", SHA256: strings.Repeat("ef", 32), SourceURL: stream + "/forever.raw", Format: "raw"}
	st = failedWith(t, a, never)
	if !strings.Contains(st.Reason, hint+" (it sent more than 1048576 bytes)") || !strings.Contains(st.Reason, raise) {
		t.Errorf("a never-ending answer: reason %q", st.Reason)
	}
	if n := wrote.Load(); n >= 256<<20 {
		t.Errorf("the endless source wrote %d bytes: the agent read to the server's own end", n)
	}
	if left := cacheEntries(t, a.CacheDir()); len(left) != 0 {
		t.Errorf("cache holds %v", left)
	}
	if _, err := os.Stat(filepath.Join(a.CacheDir(), "sha256", ".partial-"+never.SHA256)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("partial file of the cut image: %v", err)
	}
	if image.DefaultMaxBytes != 64<<30 {
		t.Errorf("default cap %d, want 64 GiB as the docs say", image.DefaultMaxBytes)
	}
}
