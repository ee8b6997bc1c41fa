package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
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
	if total > 0 {
		if err := checkSpace(c.dir, total-have); err != nil {
			_ = os.Remove(partial)
			return errPermanent{err}
		}
	}
	n, err := copyStalled(ctx, io.MultiWriter(f, h), body, c.cfg.StallTimeout)
	if err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			_ = os.Remove(partial)
			return errPermanent{fmt.Errorf("the image directory %s is full (no space left on device) after %d bytes of image %s: free space there and create again",
				c.cfg.ImageDir, have+n, src.Name)}
		}
		return fmt.Errorf("read %s after %d bytes: %w", redact(u), have+n, err)
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
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, 0, false, errPermanent{err}
	}
	client := c.cfg.HTTP
	if peer {
		client = c.cfg.PeerHTTP
		req.Header.Set("Authorization", "Bearer "+c.cfg.PeerToken)
	}
	if offset > 0 {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(offset, 10)+"-")
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, 0, false, fmt.Errorf("get %s: %w", redact(u), err)
	}
	switch {
	case resp.StatusCode == http.StatusPartialContent && offset > 0:
		// Content-Range: bytes <offset>-<end>/<total>
		cr := resp.Header.Get("Content-Range")
		var start, end, total int64
		if _, err := fmt.Sscanf(cr, "bytes %d-%d/%d", &start, &end, &total); err != nil || start != offset {
			_ = resp.Body.Close()
			return nil, 0, false, fmt.Errorf("get %s: unexpected Content-Range %q for offset %d", redact(u), cr, offset)
		}
		return resp.Body, total, true, nil
	case resp.StatusCode == http.StatusOK:
		return resp.Body, resp.ContentLength, false, nil
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable:
		_ = resp.Body.Close()
		// The partial file is longer than the source: start over next time.
		return nil, 0, false, fmt.Errorf("get %s: range from %d not satisfiable; restarting", redact(u), offset)
	default:
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		_ = resp.Body.Close()
		err := fmt.Errorf("get %s: %s: %s", redact(u), resp.Status, strings.TrimSpace(string(b)))
		if resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != http.StatusTooManyRequests {
			return nil, 0, false, errPermanent{err}
		}
		return nil, 0, false, err
	}
}

// copyStalled copies like io.Copy but fails when no byte arrives for stall.
func copyStalled(ctx context.Context, dst io.Writer, src io.Reader, stall time.Duration) (int64, error) {
	buf := make([]byte, 1<<20)
	var n int64
	timer := time.AfterFunc(stall, func() {
		if c, ok := src.(io.Closer); ok {
			_ = c.Close()
		}
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
		if rerr != nil {
			return n, rerr
		}
	}
}

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
