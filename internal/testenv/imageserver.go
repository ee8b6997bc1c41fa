package testenv

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// ImageServer serves image files over HTTP on 127.0.0.1, as a source URL
// of registered images, and counts what it serves.
type ImageServer struct {
	URL string // http://127.0.0.1:port

	dir       string
	srv       *http.Server
	downloads atomic.Int64 // GETs that started at byte 0
	requests  atomic.Int64 // every GET, ranges too
	bytes     atomic.Int64

	mu        sync.Mutex
	dropAfter int64 // > 0: the next GET is cut after this many bytes
	delay     time.Duration
	pause     time.Duration // between writes of at most 64 KiB (a slow link)
}

// StartImageServer serves the files of dir until the test ends.
func StartImageServer(t testing.TB, dir string) *ImageServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: image server: %v", err)
	}
	s := &ImageServer{URL: "http://" + ln.Addr().String(), dir: dir}
	s.srv = &http.Server{Handler: http.HandlerFunc(s.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.srv.Serve(ln) }()
	t.Cleanup(func() { _ = s.srv.Close() })
	return s
}

// Downloads is how many GETs asked for a file from its start.
func (s *ImageServer) Downloads() int64 { return s.downloads.Load() }

// Requests is how many GETs came, ranged ones too.
func (s *ImageServer) Requests() int64 { return s.requests.Load() }

// BytesServed is the body bytes written.
func (s *ImageServer) BytesServed() int64 { return s.bytes.Load() }

// DropNextAfter cuts the next GET's connection after n body bytes.
func (s *ImageServer) DropNextAfter(n int64) {
	s.mu.Lock()
	s.dropAfter = n
	s.mu.Unlock()
}

// Delay holds every answer for d before the body (so that concurrent
// callers overlap).
func (s *ImageServer) Delay(d time.Duration) {
	s.mu.Lock()
	s.delay = d
	s.mu.Unlock()
}

// Slow makes every answer write its body 64 KiB at a time with pause
// between writes (0: full speed again).
func (s *ImageServer) Slow(pause time.Duration) {
	s.mu.Lock()
	s.pause = pause
	s.mu.Unlock()
}

// FileURL is the URL of a file of the served folder.
func (s *ImageServer) FileURL(name string) string { return s.URL + "/" + name }

type countingWriter struct {
	http.ResponseWriter
	n     *atomic.Int64
	limit int64 // > 0: fail after this many bytes
	wrote int64
	pause time.Duration
}

func (w *countingWriter) Write(p []byte) (int, error) {
	if w.pause > 0 {
		total := 0
		for len(p) > 0 {
			k := min(len(p), 64<<10)
			time.Sleep(w.pause)
			n, err := w.write(p[:k])
			total += n
			if err != nil {
				return total, err
			}
			if f, ok := w.ResponseWriter.(http.Flusher); ok {
				f.Flush()
			}
			p = p[k:]
		}
		return total, nil
	}
	return w.write(p)
}

func (w *countingWriter) write(p []byte) (int, error) {
	if w.limit > 0 && w.wrote+int64(len(p)) > w.limit {
		p = p[:w.limit-w.wrote]
		k, _ := w.ResponseWriter.Write(p)
		w.wrote += int64(k)
		w.n.Add(int64(k))
		panic(http.ErrAbortHandler) // ends the connection mid-body
	}
	k, err := w.ResponseWriter.Write(p)
	w.wrote += int64(k)
	w.n.Add(int64(k))
	return k, err
}

func (s *ImageServer) serve(w http.ResponseWriter, r *http.Request) {
	name := strings.TrimPrefix(r.URL.Path, "/")
	if name == "" || name != filepath.Base(name) {
		http.NotFound(w, r)
		return
	}
	f, err := os.Open(filepath.Join(s.dir, name))
	if err != nil {
		http.NotFound(w, r)
		return
	}
	defer func() { _ = f.Close() }()
	s.requests.Add(1)
	if r.Header.Get("Range") == "" {
		s.downloads.Add(1)
	}
	s.mu.Lock()
	drop, delay, pause := s.dropAfter, s.delay, s.pause
	s.dropAfter = 0
	s.mu.Unlock()
	if delay > 0 {
		time.Sleep(delay)
	}
	http.ServeContent(&countingWriter{ResponseWriter: w, n: &s.bytes, limit: drop, pause: pause}, r, name, time.Time{}, f)
}

// FileSHA256 is the hex sha256 of a file.
func FileSHA256(t testing.TB, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// BundleImage writes a kernel bundle of the image folder src to dst and
// returns its sha256 (image.WriteBundle).
func BundleImage(t testing.TB, src, dst string) string {
	t.Helper()
	sha, err := image.WriteBundle(src, dst)
	if err != nil {
		t.Fatalf("testenv: bundle %s: %v", src, err)
	}
	return sha
}

// WriteQCOW2 writes a small real qcow2 file of virtual size sizeMiB with
// qemu-img and returns its path.
func WriteQCOW2(t testing.TB, dir, name string, sizeMiB int64) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if out, err := runQemuImg("create", "-q", "-f", "qcow2", path, strconv.FormatInt(sizeMiB, 10)+"M"); err != nil {
		t.Fatalf("testenv: qemu-img create: %v: %s", err, out)
	}
	return path
}

func runQemuImg(args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return exec.CommandContext(ctx, "qemu-img", args...).CombinedOutput()
}

// RegisterGuestImage registers the busybox guest image as an image like any
// other, under name: a kernel bundle of its folder, by file:// URL and
// sha256. The agents fetch it into their caches when a VM needs it.
func (c *Control) RegisterGuestImage(t testing.TB, name string) api.Image {
	t.Helper()
	tarPath := filepath.Join(t.TempDir(), name+".tar")
	sha := BundleImage(t, filepath.Join(GuestImageDir(t), guestImageName), tarPath)
	img, err := c.Client.CreateImage(context.Background(), api.ImageCreate{
		Name: name, SourceURL: "file://" + tarPath, SHA256: sha, Format: api.ImageFormatKernel,
	})
	if err != nil {
		t.Fatalf("testenv: register image %s: %v", name, err)
	}
	return img
}
