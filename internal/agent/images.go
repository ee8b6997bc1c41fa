package agent

// Registered images (the control API's /v1/images): the agent fetches them
// into its content-addressed cache (internal/agent/image) the first time a
// VM needs one, or at once on PUT /v1/images/{sha256} (prefetch), and serves
// ready ones to peer agents. A VM of a registered image records the cache's
// name of it, "sha256:<hex>", which the drivers resolve to the image folder.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// resolveImage turns a VM spec of a registered image into one the driver
// reads: Image becomes the cache's name of the image. It fetches nothing.
func (a *Agent) resolveImage(spec agentapi.VMSpec) (agentapi.VMSpec, error) {
	src := spec.ImageSource
	if src == nil {
		return spec, nil
	}
	if a.images == nil {
		return spec, errInvalid("image %s is a registered image, but this agent has no image cache: start it with --image-dir", spec.Image)
	}
	if src.Name == "" {
		src.Name = spec.Image
	}
	if err := image.CheckSource(*src); err != nil {
		return spec, errInvalid("image %s: %v", spec.Image, err)
	}
	spec.Image = image.Ref(src.SHA256)
	return spec, nil
}

// ensureImage fetches the spec's registered image when the cache lacks it
// (or waits for the fetch in flight) and fails with the reason when it
// cannot be had.
func (a *Agent) ensureImage(ctx context.Context, src *agentapi.ImageSource) error {
	if src == nil {
		return nil
	}
	if _, err := a.images.Ensure(ctx, *src); err != nil {
		return &Error{Status: http.StatusUnprocessableEntity, Code: CodeImageFailed, Message: err.Error(),
			Details: map[string]any{"image": src.Name, "sha256": src.SHA256}}
	}
	return nil
}

// verifyImagePeer is the image cache's check of a peer before it sends the
// agent token there: the peer's identity challenge, as for snapshot pulls.
func (a *Agent) verifyImagePeer(ctx context.Context, p agentapi.ImagePeer) error {
	key, err := agentapi.DecodeKey(p.PublicKey)
	if err != nil {
		return fmt.Errorf("peer %s: public_key: %w", p.Address, err)
	}
	return a.verifyPeer(ctx, &peer{address: p.Address, key: key})
}

// CodeImageFailed is the code of a create whose image could not be fetched.
const CodeImageFailed = "image_failed"

// imageUsers lists the VMs and snapshots that use the cached image.
func (a *Agent) imageUsers(hex string) []string {
	ref := image.Ref(hex)
	var users []string
	for _, e := range a.vms.all() {
		if r, _, gone := e.state(); !gone && r.Image == ref {
			users = append(users, "vm "+r.ID)
		}
	}
	for _, s := range a.snapshotsOfImage(ref) {
		users = append(users, "snapshot "+s)
	}
	sort.Strings(users)
	return users
}

// RemoveImage garbage-collects one image of the cache: refused (409) while
// a VM or snapshot uses it.
func (a *Agent) RemoveImage(hex string) error {
	if a.images == nil {
		return nil
	}
	if !image.ValidDigest(hex) {
		return errInvalid("sha256 %q is not 64 lower-case hex digits", hex)
	}
	if users := a.imageUsers(hex); len(users) > 0 {
		e := errConflict("image sha256 %s is used by %v; delete those first", hex, users)
		e.Details = map[string]any{"used_by": users}
		return e
	}
	if err := a.images.Remove(hex); err != nil {
		if errors.Is(err, image.ErrBusy) {
			return errConflict("image sha256 %s is being fetched; delete it once the fetch ends", hex)
		}
		return err
	}
	a.log.Info("image removed from the cache", "sha256", hex)
	return nil
}

func (a *Agent) imageList() []agentapi.ImageStatus {
	if a.images == nil {
		return []agentapi.ImageStatus{}
	}
	return a.images.List()
}

func (a *Agent) imageRoutes(v1 *echo.Group) {
	v1.GET("/images", func(c echo.Context) error {
		return c.JSON(http.StatusOK, agentapi.ImageList{Items: a.imageList()})
	})
	v1.GET("/images/:sha", func(c echo.Context) error {
		if a.images != nil {
			if st, ok := a.images.Get(c.Param("sha")); ok {
				return c.JSON(http.StatusOK, st)
			}
		}
		return &Error{Status: http.StatusNotFound, Code: CodeNotFound, Message: fmt.Sprintf("image sha256 %s is not in this agent's cache", c.Param("sha"))}
	})
	v1.PUT("/images/:sha", func(c echo.Context) error {
		var src agentapi.ImageSource
		if err := bindJSON(c, &src); err != nil {
			return err
		}
		if src.SHA256 != c.Param("sha") {
			return errInvalid("body sha256 %q does not match the path's %q", src.SHA256, c.Param("sha"))
		}
		if a.images == nil {
			return errInvalid("this agent has no image cache: start it with --image-dir")
		}
		st, err := a.images.Start(src)
		if err != nil {
			return errInvalid("image %s: %v", src.Name, err)
		}
		return c.JSON(http.StatusOK, st)
	})
	v1.DELETE("/images/:sha", func(c echo.Context) error {
		if err := a.RemoveImage(c.Param("sha")); err != nil {
			return err
		}
		return c.NoContent(http.StatusNoContent)
	})
	// The verified bytes, for a peer agent; Range requests resume.
	v1.GET("/images/:sha/blob", func(c echo.Context) error {
		if a.images == nil {
			return &Error{Status: http.StatusNotFound, Code: CodeNotFound, Message: "this agent has no image cache"}
		}
		f, st, err := a.images.Blob(c.Param("sha"))
		if err != nil {
			return &Error{Status: http.StatusNotFound, Code: CodeNotFound,
				Message: fmt.Sprintf("image sha256 %s is not ready in this agent's cache", c.Param("sha"))}
		}
		defer func() { _ = f.Close() }()
		c.Response().Header().Set("X-Image-SHA256", st.SHA256)
		c.Response().Header().Set("X-Image-Size", strconv.FormatInt(st.SizeBytes, 10))
		http.ServeContent(c.Response(), c.Request(), "", time.Time{}, f)
		return nil
	})
}

// snapshotsOfImage lists the snapshots of the image named ref.
func (a *Agent) snapshotsOfImage(ref string) []string {
	var out []string
	for _, s := range a.snaps.all() {
		if rec, _, gone := s.state(); rec != nil && !gone && rec.Image == ref {
			out = append(out, s.id)
		}
	}
	return out
}
