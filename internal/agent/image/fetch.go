package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// errPermanent marks a failure that another attempt of the same source
// cannot fix (a 404, a wrong digest): the next source is tried at once.
type errPermanent struct{ error }

func (e errPermanent) Unwrap() error { return e.error }

// verifyPeer has the peer prove its pinned identity before the token goes
// there.
func (c *Cache) verifyPeer(ctx context.Context, p agentapi.ImagePeer) error {
	if c.cfg.VerifyPeer == nil {
		return errors.New("this cache cannot authenticate peers")
	}
	return c.cfg.VerifyPeer(ctx, p)
}

// fetch brings the image into the cache: from each peer once, then from the
// source URL with retries. The retries are hand-written rather than
// go-retryablehttp's because what fails in practice is a body cut mid-stream,
// and only the reader knows how far it got: a retry asks for the rest
// (Range) and keeps hashing where it stopped.
func (c *Cache) fetch(ctx context.Context, src agentapi.ImageSource) (agentapi.ImageStatus, error) {
	if err := os.MkdirAll(c.dir, 0o750); err != nil {
		return agentapi.ImageStatus{}, fmt.Errorf("image cache: create %s: %w", c.dir, err)
	}
	partial := filepath.Join(c.dir, partialPrefix+src.SHA256)
	var errs []string
	for _, p := range src.Peers {
		peer, err := agentapi.CheckAddress(p.Address)
		if err == nil {
			err = c.verifyPeer(ctx, p)
		}
		if err != nil {
			if ctx.Err() != nil {
				return agentapi.ImageStatus{}, ctx.Err()
			}
			c.log.Warn("image peer not used: it did not prove its identity; trying the next source", "image", src.Name, "peer", p.Address, "err", err)
			errs = append(errs, err.Error())
			continue
		}
		err = c.download(ctx, src, peer+"/v1/images/"+src.SHA256+"/blob", partial, true)
		if err == nil {
			return c.install(src, partial, "peer "+peer)
		}
		if ctx.Err() != nil {
			return agentapi.ImageStatus{}, ctx.Err()
		}
		c.log.Warn("image fetch from peer failed; trying the next source", "image", src.Name, "peer", peer, "err", err)
		errs = append(errs, err.Error())
		_ = os.Remove(partial) // a peer's bytes are not resumed from another source
	}
	var err error
	for attempt := 0; attempt < c.cfg.Attempts; attempt++ {
		if attempt > 0 {
			wait := min(c.cfg.Backoff<<(attempt-1), 5*time.Second)
			select {
			case <-ctx.Done():
				return agentapi.ImageStatus{}, ctx.Err()
			case <-time.After(wait):
			}
			c.log.Info("image fetch retry", "image", src.Name, "attempt", attempt+1, "err", err)
		}
		err = c.download(ctx, src, src.SourceURL, partial, false)
		if err == nil {
			return c.install(src, partial, redact(src.SourceURL))
		}
		if ctx.Err() != nil {
			// The agent is stopping: the partial file stays, so that the
			// next fetch resumes it.
			return agentapi.ImageStatus{}, fmt.Errorf("fetch of image %s stopped: %w", src.Name, ctx.Err())
		}
		var perm errPermanent
		if errors.As(err, &perm) {
			break
		}
	}
	_ = os.Remove(partial)
	errs = append(errs, err.Error())
	return agentapi.ImageStatus{}, errors.New(strings.Join(errs, "; "))
}

// download fetches u into partial (resuming what partial holds) and checks
// the digest of the whole. A wrong digest removes partial.
func (c *Cache) download(ctx context.Context, src agentapi.ImageSource, u, partial string, peer bool) error {
	f, err := os.OpenFile(partial, os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		return errPermanent{fmt.Errorf("open %s: %w", partial, err)}
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	have, err := io.Copy(h, f) // the bytes of an earlier attempt
	if err != nil {
		return fmt.Errorf("read %s: %w", partial, err)
	}
	body, total, resumed, err := c.open(ctx, u, have, peer)
	if err != nil {
		return err
	}
	defer func() { _ = body.Close() }()
	if !resumed && have > 0 {
		// The source sends the whole file again: start over.
		if err := f.Truncate(0); err != nil {
			return fmt.Errorf("truncate %s: %w", partial, err)
		}
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return err
		}
		h.Reset()
		have = 0
	}
	limit := c.cfg.MaxBytes
	if total > limit {
		_ = os.Remove(partial)
		return errPermanent{c.tooLarge(src, u, fmt.Sprintf("its size is %d bytes", total), limit)}
	}
	if total > 0 {
		if err := checkSpace(c.dir, total-have); err != nil {
			_ = os.Remove(partial)
			return errPermanent{err}
		}
	}
	// One byte past the cap tells a source that never ends (or lied in
	// its Content-Length) from one of exactly the cap.
	n, err := copyStalled(ctx, io.MultiWriter(f, h), io.LimitReader(body, limit-have+1), body, c.cfg.StallTimeout)
	if err == nil && have+n > limit {
		_ = os.Remove(partial)
		return errPermanent{c.tooLarge(src, u, fmt.Sprintf("it sent more than %d bytes", limit), limit)}
	}
	if err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			_ = os.Remove(partial)
			return errPermanent{fmt.Errorf("the image directory %s is full (no space left on device) after %d bytes of image %s: free space there and create again",
				c.cfg.ImageDir, have+n, src.Name)}
		}
		return fmt.Errorf("read %s after %d bytes: %w", redact(u), have+n, c.transportError(u, err))
	}
	if total > 0 && have+n != total {
		return fmt.Errorf("read %s: got %d of %d bytes", redact(u), have+n, total)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != src.SHA256 {
		_ = os.Remove(partial)
		return errPermanent{fmt.Errorf("sha256 mismatch for image %s from %s: expected %s, got %s; check the sha256 or the source",
			src.Name, redact(u), src.SHA256, got)}
	}
	if err := f.Sync(); err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			_ = os.Remove(partial)
		}
		return errPermanent{fmt.Errorf("sync %s: %w", partial, err)}
	}
	return nil
}

// open starts reading u from offset. resumed says that the reader starts at
// offset; otherwise it starts at 0. total is the whole size when known.
func (c *Cache) open(ctx context.Context, u string, offset int64, peer bool) (io.ReadCloser, int64, bool, error) {
	pu, err := url.Parse(u)
	if err != nil {
		return nil, 0, false, errPermanent{fmt.Errorf("source_url %q: %w", u, err)}
	}
	if pu.Scheme == "file" {
		f, err := os.Open(pu.Path)
		if err != nil {
			return nil, 0, false, errPermanent{fmt.Errorf("open %s on this host: %w", pu.Path, err)}
		}
		fi, err := f.Stat()
		if err != nil || !fi.Mode().IsRegular() {
			_ = f.Close()
			return nil, 0, false, errPermanent{fmt.Errorf("open %s on this host: not a regular file", pu.Path)}
		}
		if offset > 0 && offset <= fi.Size() {
			if _, err := f.Seek(offset, io.SeekStart); err == nil {
				return f, fi.Size(), true, nil
			}
		}
		return f, fi.Size(), false, nil
	}
	client := c.source
	if peer {
		client = c.cfg.PeerHTTP
	} else {
		ctx = context.WithValue(ctx, allowedKey{}, sourceAllows(ctx, pu))
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, 0, false, errPermanent{fmt.Errorf("GET %s: %w", redact(u), err)}
	}
	if peer {
		req.Header.Set("Authorization", "Bearer "+c.cfg.PeerToken)
		version.SetHeaders(req.Header)
	}
	if offset > 0 {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(offset, 10)+"-")
	}
	// What the remote end says (bodies, reason phrases, headers, the URLs
	// it redirects to) never goes into an error: the error becomes the
	// image's status, which user tokens read.
	resp, err := client.Do(req)
	if err != nil {
		err = fmt.Errorf("GET %s: %w", redact(u), c.transportError(u, err))
		if errors.Is(err, errAddressRefused) || errors.Is(err, errRedirect) {
			return nil, 0, false, errPermanent{err}
		}
		return nil, 0, false, err
	}
	switch {
	case resp.StatusCode == http.StatusPartialContent && offset > 0:
		// Content-Range: bytes <offset>-<end>/<total>
		var start, end, total int64
		if _, err := fmt.Sscanf(resp.Header.Get("Content-Range"), "bytes %d-%d/%d", &start, &end, &total); err != nil || start != offset {
			_ = resp.Body.Close()
			return nil, 0, false, fmt.Errorf("GET %s: a 206 answer whose Content-Range does not start at offset %d", redact(u), offset)
		}
		return resp.Body, total, true, nil
	case resp.StatusCode == http.StatusOK:
		return resp.Body, resp.ContentLength, false, nil
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable:
		_ = resp.Body.Close()
		// The partial file is longer than the source: start over next time.
		return nil, 0, false, fmt.Errorf("GET %s: range from %d not satisfiable; restarting", redact(u), offset)
	default:
		_ = resp.Body.Close()
		err := fmt.Errorf("GET %s: %d %s", redact(u), resp.StatusCode, http.StatusText(resp.StatusCode))
		if resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != http.StatusTooManyRequests {
			return nil, 0, false, errPermanent{err}
		}
		return nil, 0, false, err
	}
}

// tooLarge is the reason an image over the cap fails with.
func (c *Cache) tooLarge(src agentapi.ImageSource, u, what string, limit int64) error {
	return fmt.Errorf("image %s from %s is larger than this agent's cap of %d bytes (%s); "+
		"if the image is right, raise the cap with kvmd agent --image-max-bytes (KVMD_IMAGE_MAX_BYTES)", src.Name, redact(u), limit, what)
}

// transportError is err as an image's status may show it: what the agent
// itself found (a refused address or redirect, a network error, a
// timeout), never text of the remote end, which some errors of net/http
// quote (a malformed status line, an HTTP/2 GOAWAY's debug data, the URL a
// redirect named). The whole error goes to the agent's log.
func (c *Cache) transportError(u string, err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err // its URL may be where a redirect led
	}
	var ne net.Error
	var oe *net.OpError
	var pe *fs.PathError
	var errno syscall.Errno
	switch {
	case errors.Is(err, errAddressRefused), errors.Is(err, errRedirect),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, errStalled):
		return err
	case errors.As(err, &pe), errors.As(err, &errno): // this host's own files
		return err
	case errors.As(err, &oe):
		return oe
	case errors.As(err, &ne) && ne.Timeout():
		return errors.New("timeout")
	}
	c.log.Warn("image source: the answer was not usable HTTP", "url", redact(u), "err", err)
	return errors.New("the answer was not usable HTTP (the agent's log has the details)")
}

// copyStalled copies like io.Copy but fails when no byte arrives for stall
// (closing closer ends a read that hangs).
func copyStalled(ctx context.Context, dst io.Writer, src io.Reader, closer io.Closer, stall time.Duration) (int64, error) {
	buf := make([]byte, 1<<20)
	var n int64
	var stalled atomic.Bool
	timer := time.AfterFunc(stall, func() {
		stalled.Store(true)
		_ = closer.Close()
	})
	defer timer.Stop()
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		k, rerr := src.Read(buf)
		if k > 0 {
			timer.Reset(stall)
			w, werr := dst.Write(buf[:k])
			n += int64(w)
			if werr != nil {
				return n, werr
			}
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil && stalled.Load() {
			return n, fmt.Errorf("%w for %s", errStalled, stall)
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// errStalled is a read cut because no byte came.
var errStalled = errors.New("no byte came")

// checkSpace refuses a download that does not fit in dir's file system.
func checkSpace(dir string, need int64) error {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return nil // unknown: the write finds out
	}
	free := int64(st.Bavail) * st.Bsize //nolint:gosec // block counts fit in int64
	if need > free {
		return fmt.Errorf("the image directory %s has %d bytes free, the image needs %d more: free space there and create again", dir, free, need)
	}
	return nil
}

// redact drops the user info and query of a URL for messages and logs.
func redact(u string) string {
	pu, err := url.Parse(u)
	if err != nil {
		return "the source URL"
	}
	pu.User, pu.RawQuery = nil, ""
	return pu.String()
}
