// Package image is the agent's content-addressed image cache: it fetches a
// registered image from a peer agent that has it, else from its source URL
// (http, https or file://), verifies the sha256 while the bytes stream, and
// keeps it under <image-dir>/sha256/<hex>/ in the image folder layout the
// drivers read (image.json and the files it names).
//
// An image is used only once it is complete: the bytes go to a partial file
// (kept between attempts so that a retry resumes with a Range request), the
// digest is checked, the file is synced, unpacked into a temporary folder,
// and that folder is renamed into place. One fetch per image runs at a time;
// every caller that needs the image waits on that one fetch.
package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	// sourceFile records, in a ready image folder, what the image is.
	sourceFile = "source.json"
	// partialPrefix marks a download in progress: <sha256dir>/.partial-<hex>.
	partialPrefix = ".partial-"
	// stagePrefix marks an image folder being unpacked.
	stagePrefix = ".stage-"
)

var hexPattern = regexp.MustCompile(`^[0-9a-f]{64}$`)

// ValidDigest says whether s is a sha256 digest in lower-case hex.
func ValidDigest(s string) bool { return hexPattern.MatchString(s) }

// RefPrefix names a cached image to a driver: "sha256:<hex>".
const RefPrefix = "sha256:"

// Ref is the driver's name of the cached image with this digest.
func Ref(hex string) string { return RefPrefix + hex }

// DigestOfRef returns the digest of a driver image name made by Ref.
func DigestOfRef(name string) (string, bool) {
	hex, ok := strings.CutPrefix(name, RefPrefix)
	return hex, ok && ValidDigest(hex)
}

// FolderOf is the folder of the cached image named by ref under imageDir.
func FolderOf(imageDir, ref string) (string, bool) {
	hex, ok := DigestOfRef(ref)
	if !ok {
		return "", false
	}
	return filepath.Join(imageDir, "sha256", hex), true
}

// DefaultMaxBytes is the default cap of an image's size: 64 GiB.
const DefaultMaxBytes int64 = 64 << 30

// Config configures a Cache.
type Config struct {
	// ImageDir is the agent's --image-dir; the cache lives in ImageDir/sha256.
	ImageDir string
	// MaxBytes caps the size of an image fetched (kvmd agent
	// --image-max-bytes; default DefaultMaxBytes): a larger Content-Length
	// is refused before a byte is read, and a body that goes on is cut
	// there.
	MaxBytes int64
	// PeerHTTP and PeerToken fetch from other agents. PeerHTTP never
	// follows a redirect: the token goes only to the peer that proved
	// itself.
	PeerHTTP  *http.Client
	PeerToken string
	// VerifyPeer proves that a peer is the agent the control plane pinned
	// (its identity challenge, which carries no token) before the cache
	// sends it PeerToken; a peer that fails it is skipped. Nil: every peer
	// is skipped and images come from their sources.
	VerifyPeer func(ctx context.Context, p agentapi.ImagePeer) error
	// Attempts is how many times a source is tried (default 5); the wait
	// between attempts doubles from Backoff (default 200 ms) up to 5 s.
	Attempts int
	Backoff  time.Duration
	// StallTimeout ends a read that brings no byte for this long (default 30 s).
	StallTimeout time.Duration
	Logger       *slog.Logger
}

// Cache is the image cache of one agent. Its goroutines are the fetches in
// flight, which Close cancels and waits for.
type Cache struct {
	cfg Config
	dir string // ImageDir/sha256
	// source fetches from source URLs (guard.go): no overall timeout, as
	// a large image takes long; a stalled read is cut by StallTimeout.
	source *http.Client
	log    *slog.Logger
	ctx    context.Context
	stop   context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	entries map[string]*entry
}

// entry is one image: ready, failed, or being fetched (done is open).
type entry struct {
	done   chan struct{}
	status agentapi.ImageStatus
}

// New opens the cache and lists the images it already holds. Leftover
// stage folders are removed; partial downloads stay for a later resume.
func New(cfg Config) (*Cache, error) {
	if cfg.ImageDir == "" {
		return nil, errors.New("image cache: no image directory: give --image-dir")
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	peerHTTP := &http.Client{}
	if cfg.PeerHTTP != nil {
		c := *cfg.PeerHTTP
		peerHTTP = &c
	}
	peerHTTP.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	cfg.PeerHTTP = peerHTTP
	if cfg.Attempts <= 0 {
		cfg.Attempts = 5
	}
	if cfg.Backoff <= 0 {
		cfg.Backoff = 200 * time.Millisecond
	}
	if cfg.StallTimeout <= 0 {
		cfg.StallTimeout = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &Cache{cfg: cfg, dir: filepath.Join(cfg.ImageDir, "sha256"), source: newSourceClient(), log: cfg.Logger, entries: map[string]*entry{}}
	c.ctx, c.stop = context.WithCancel(context.Background())
	// The folder is made by the first fetch: an agent that never fetches
	// leaves its image directory as it found it.
	des, err := os.ReadDir(c.dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("image cache: read %s: %w", c.dir, err)
	}
	for _, de := range des {
		name := de.Name()
		switch {
		case strings.HasPrefix(name, stagePrefix):
			_ = os.RemoveAll(filepath.Join(c.dir, name))
		case ValidDigest(name) && de.IsDir():
			st, err := readSource(filepath.Join(c.dir, name))
			if err != nil {
				c.log.Warn("image cache: unreadable image folder moved aside", "sha256", name, "err", err)
				_ = os.Rename(filepath.Join(c.dir, name), filepath.Join(c.dir, stagePrefix+name+".bad"))
				continue
			}
			done := make(chan struct{})
			close(done)
			c.entries[name] = &entry{done: done, status: st}
		}
	}
	return c, nil
}

// Close cancels the fetches in flight and waits for them; their partial
// files stay for a resume.
func (c *Cache) Close() {
	c.stop()
	c.wg.Wait()
}

// Folder is the image folder of a ready image.
func (c *Cache) Folder(hex string) string { return filepath.Join(c.dir, hex) }

// List returns every image of the cache, sorted by digest.
func (c *Cache) List() []agentapi.ImageStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]agentapi.ImageStatus, 0, len(c.entries))
	for _, e := range c.entries {
		out = append(out, e.status)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].SHA256 < out[j].SHA256 })
	return out
}

// Get returns one image's status.
func (c *Cache) Get(hex string) (agentapi.ImageStatus, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[hex]
	if !ok {
		return agentapi.ImageStatus{}, false
	}
	return e.status, true
}

// CheckSource refuses a source the cache cannot fetch.
func CheckSource(src agentapi.ImageSource) error {
	if !ValidDigest(src.SHA256) {
		return fmt.Errorf("sha256 %q is not 64 lower-case hex digits", src.SHA256)
	}
	switch src.Format {
	case agentapi.ImageFormatQCOW2, agentapi.ImageFormatRaw, agentapi.ImageFormatKernel:
	default:
		return fmt.Errorf("format %q: want qcow2, raw or kernel", src.Format)
	}
	scheme, _, ok := strings.Cut(src.SourceURL, "://")
	if !ok || (scheme != "http" && scheme != "https" && scheme != "file") {
		return fmt.Errorf("source_url %q: want an http, https or file:// URL", src.SourceURL)
	}
	if len(src.Peers) > MaxPeers {
		return fmt.Errorf("%d peers: at most %d", len(src.Peers), MaxPeers)
	}
	for i, p := range src.Peers {
		if _, err := agentapi.CheckAddress(p.Address); err != nil {
			return fmt.Errorf("peers[%d]: %w", i, err)
		}
		if _, err := agentapi.DecodeKey(p.PublicKey); err != nil {
			return fmt.Errorf("peers[%d] %s: public_key, the identity key the control plane pinned for that agent: %w", i, p.Address, err)
		}
	}
	return nil
}

// MaxPeers bounds the peers of one image source.
const MaxPeers = 8

// Start makes sure a fetch of the image runs or has run and returns its
// status at once: ready, fetching, or (a failed image is fetched again)
// fetching once more.
func (c *Cache) Start(src agentapi.ImageSource) (agentapi.ImageStatus, error) {
	e, err := c.start(src)
	if err != nil {
		return agentapi.ImageStatus{}, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return e.status, nil
}

func (c *Cache) start(src agentapi.ImageSource) (*entry, error) {
	if err := CheckSource(src); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.entries[src.SHA256]; ok && e.status.Status != agentapi.ImageFailed {
		return e, nil
	}
	if c.ctx.Err() != nil {
		return nil, errors.New("image cache is closed")
	}
	e := &entry{done: make(chan struct{}), status: agentapi.ImageStatus{
		SHA256: src.SHA256, Name: src.Name, Format: src.Format, Status: agentapi.ImageFetching,
	}}
	c.entries[src.SHA256] = e
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		st, err := c.fetch(c.ctx, src)
		c.mu.Lock()
		if err != nil {
			e.status.Status, e.status.Reason = agentapi.ImageFailed, err.Error()
			c.log.Error("image fetch failed", "image", src.Name, "sha256", src.SHA256, "err", err)
		} else {
			e.status = st
			c.log.Info("image ready", "image", src.Name, "sha256", src.SHA256, "from", st.From, "size_bytes", st.SizeBytes)
		}
		c.mu.Unlock()
		close(e.done)
	}()
	return e, nil
}

// Ensure returns once the image is ready (fetching it when needed, or
// waiting for the fetch in flight), or with the reason it failed.
func (c *Cache) Ensure(ctx context.Context, src agentapi.ImageSource) (agentapi.ImageStatus, error) {
	e, err := c.start(src)
	if err != nil {
		return agentapi.ImageStatus{}, err
	}
	select {
	case <-e.done:
	case <-ctx.Done():
		return agentapi.ImageStatus{}, fmt.Errorf("wait for image %s (sha256 %s): %w", src.Name, src.SHA256, ctx.Err())
	}
	c.mu.Lock()
	st := e.status
	c.mu.Unlock()
	if st.Status != agentapi.ImageReady {
		return st, fmt.Errorf("image %s (sha256 %s) failed on this host: %s", src.Name, src.SHA256, st.Reason)
	}
	return st, nil
}

// ErrBusy is returned by Remove for an image being fetched.
var ErrBusy = errors.New("image is being fetched")

// Remove deletes an image from the cache (the caller checks that no VM uses
// it). Removing an image the cache does not hold succeeds.
func (c *Cache) Remove(hex string) error {
	if !ValidDigest(hex) {
		return fmt.Errorf("sha256 %q is not 64 lower-case hex digits", hex)
	}
	c.mu.Lock()
	e, ok := c.entries[hex]
	if ok && e.status.Status == agentapi.ImageFetching {
		c.mu.Unlock()
		return ErrBusy
	}
	delete(c.entries, hex)
	c.mu.Unlock()
	trash := filepath.Join(c.dir, fmt.Sprintf("%s%s-%d", stagePrefix, hex, time.Now().UnixNano()))
	if err := os.Rename(filepath.Join(c.dir, hex), trash); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove image %s: %w", hex, err)
	}
	_ = os.Remove(filepath.Join(c.dir, partialPrefix+hex))
	return os.RemoveAll(trash)
}

// Blob opens the verified bytes of a ready image, as they were fetched, for
// a peer.
func (c *Cache) Blob(hex string) (*os.File, agentapi.ImageStatus, error) {
	st, ok := c.Get(hex)
	if !ok || st.Status != agentapi.ImageReady {
		return nil, st, os.ErrNotExist
	}
	f, err := os.Open(filepath.Join(c.dir, hex, blobName(st.Format)))
	return f, st, err
}

func readSource(dir string) (agentapi.ImageStatus, error) {
	b, err := os.ReadFile(filepath.Join(dir, sourceFile))
	if err != nil {
		return agentapi.ImageStatus{}, err
	}
	var st agentapi.ImageStatus
	if err := json.Unmarshal(b, &st); err != nil {
		return agentapi.ImageStatus{}, fmt.Errorf("%s: %w", sourceFile, err)
	}
	if _, err := os.Stat(filepath.Join(dir, blobName(st.Format))); err != nil {
		return agentapi.ImageStatus{}, err
	}
	st.Status, st.Reason = agentapi.ImageReady, ""
	return st, nil
}

// blobName is the file of an image folder that holds the fetched bytes.
func blobName(format string) string {
	switch format {
	case agentapi.ImageFormatQCOW2:
		return "disk.qcow2"
	case agentapi.ImageFormatRaw:
		return "disk.raw"
	default:
		return "image.tar"
	}
}
