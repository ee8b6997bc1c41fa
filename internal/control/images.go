package control

// Registered images (bring your own): /v1/images. The control plane keeps
// what an image is (source, digest, format); the agents fetch it into their
// caches, the first time a VM needs it or at once when prefetch is set, and
// report per image ready, fetching or failed in /v1/info. Those reports, in
// this replica's host view, give each image's per-host status and the
// placement preference for hosts that already hold an image.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

var sha256Pattern = regexp.MustCompile(`^[0-9a-f]{64}$`)

// maxPeers bounds the peers a VM create offers its agent.
const maxPeers = 3

// imageUsersShown bounds the VMs a 409 of an image delete names.
const imageUsersShown = 20

func validateImageCreate(in api.ImageCreate) error {
	if err := validateName("name", in.Name); err != nil {
		return err
	}
	if !sha256Pattern.MatchString(in.SHA256) {
		return invalidf("sha256 %q is not a sha256 digest: give 64 lower-case hex digits (sha256sum prints them)", in.SHA256)
	}
	switch in.Format {
	case api.ImageFormatQCOW2, api.ImageFormatRaw, api.ImageFormatKernel:
	default:
		return invalidf("format %q is not one of qcow2, raw, kernel", in.Format)
	}
	switch in.Firmware {
	case "", api.FirmwareBIOS:
	case api.FirmwareUEFI:
		if in.Format == api.ImageFormatKernel {
			return invalidf("firmware uefi boots a disk image (qcow2 or raw); a kernel bundle is booted by QEMU directly: leave firmware unset")
		}
	default:
		return invalidf("firmware %q is not one of bios, uefi", in.Firmware)
	}
	u, err := url.Parse(in.SourceURL)
	if err != nil {
		return invalidf("source_url %q is not a URL: %v", in.SourceURL, err)
	}
	switch u.Scheme {
	case "http", "https":
		if u.Host == "" {
			return invalidf("source_url %q has no host", in.SourceURL)
		}
	case "file":
		if u.Host != "" || !strings.HasPrefix(u.Path, "/") {
			return invalidf("source_url %q: a file URL names an absolute path on the hosts, file:///path/to/image", in.SourceURL)
		}
	default:
		return invalidf("source_url %q: scheme %q is not supported; use http, https or file (a path on the hosts)", in.SourceURL, u.Scheme)
	}
	return validateMinDisk(in.MinDiskMiB)
}

func validateMinDisk(v int64) error {
	if v < 0 || v > 64<<20 {
		return invalidf("min_disk_mib must be between 0 and %d MiB, got %d", 64<<20, v)
	}
	return nil
}

// CreateImage registers an image; with prefetch, every alive host starts
// fetching it at once.
func (s *Service) CreateImage(ctx context.Context, in api.ImageCreate) (api.Image, error) {
	if err := validateImageCreate(in); err != nil {
		return api.Image{}, err
	}
	firmware := in.Firmware
	if firmware == "" {
		firmware = api.FirmwareBIOS
	}
	img, err := s.store.InsertImage(ctx, store.Image{Name: in.Name, SourceURL: in.SourceURL, SHA256: in.SHA256,
		Format: in.Format, MinDiskMiB: in.MinDiskMiB, Prefetch: in.Prefetch, Firmware: firmware})
	if errors.Is(err, store.ErrDuplicateName) {
		return api.Image{}, conflictf("an image named %q is already registered; choose another name or import it", in.Name)
	}
	if err != nil {
		return api.Image{}, fromStore(err, "register image "+in.Name)
	}
	s.log.Info("image registered", "image", img.Name, "sha256", img.SHA256, "format", img.Format, "firmware", img.Firmware, "prefetch", img.Prefetch)
	if img.Prefetch {
		s.prefetchEverywhere(ctx, img)
	}
	return s.apiImage(img), nil
}

// GetImage returns one image with its state on each host.
func (s *Service) GetImage(ctx context.Context, name string) (api.Image, error) {
	img, err := s.store.GetImage(ctx, name)
	if err != nil {
		return api.Image{}, fromStore(err, "read image "+name)
	}
	return s.apiImage(img), nil
}

// ListImages returns a page of images by name.
func (s *Service) ListImages(ctx context.Context, p Page) (api.List[api.Image], error) {
	return listPage(p, func(after string, limit int) ([]store.Image, error) {
		imgs, err := s.store.ListImages(ctx, after, limit)
		return imgs, fromStore(err, "list images")
	}, func(img store.Image) string { return img.Name }, each(s.apiImage))
}

// UpdateImage changes min_disk_mib and prefetch in place; turning prefetch
// on starts the fetches.
func (s *Service) UpdateImage(ctx context.Context, name string, in api.ImagePatch) (api.Image, error) {
	img, err := s.store.GetImage(ctx, name)
	if err != nil {
		return api.Image{}, fromStore(err, "read image "+name)
	}
	minDisk, prefetch := img.MinDiskMiB, img.Prefetch
	if in.MinDiskMiB != nil {
		if err := validateMinDisk(*in.MinDiskMiB); err != nil {
			return api.Image{}, err
		}
		minDisk = *in.MinDiskMiB
	}
	if in.Prefetch != nil {
		prefetch = *in.Prefetch
	}
	img, err = s.store.UpdateImage(ctx, name, minDisk, prefetch)
	if err != nil {
		return api.Image{}, fromStore(err, "update image "+name)
	}
	if img.Prefetch {
		s.prefetchEverywhere(ctx, img)
	}
	return s.apiImage(img), nil
}

// DeleteImage removes an image; 409 naming the VMs while VMs use it. The
// hosts' cached copies are removed too (best effort) unless another
// registered image has the same digest.
func (s *Service) DeleteImage(ctx context.Context, name string) error {
	img, err := s.store.DeleteImage(ctx, name)
	if errors.Is(err, store.ErrImageInUse) {
		users, _ := s.store.ImageUsers(ctx, name, imageUsersShown)
		var names, ids []string
		for _, vm := range users {
			names = append(names, fmt.Sprintf("%s (%s)", vm.Name, vm.ID))
			ids = append(ids, vm.ID)
		}
		return &Error{Code: api.CodeConflict, Err: err,
			Message: fmt.Sprintf("image %s is used by VMs %s; delete them (or give them another image) first", name, strings.Join(names, ", ")),
			Details: map[string]any{"vm_ids": ids}}
	}
	if err != nil {
		return fromStore(err, "delete image "+name)
	}
	s.log.Info("image deleted", "image", name, "sha256", img.SHA256)
	if n, err := s.store.ImagesWithDigest(ctx, img.SHA256); err == nil && n == 0 {
		s.collectImage(ctx, img)
	}
	return nil
}

// collectImage asks every host that reported the image to remove it.
func (s *Service) collectImage(ctx context.Context, img store.Image) {
	ctx, cancel := detached(ctx, 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for host := range s.view.imageHosts(img.SHA256) {
		address, alive, ok := s.view.agent(host)
		if !ok || !alive {
			continue
		}
		wg.Go(func() {
			c := s.agents.client(address)
			if err := s.agents.call("delete_image", func() error { return c.DeleteImage(ctx, img.SHA256) }); err != nil {
				s.log.Warn("remove a deleted image from a host's cache", "image", img.Name, "host", host, "err", err)
				return
			}
			s.view.dropImage(host, img.SHA256)
		})
	}
	wg.Wait()
}

// prefetchEverywhere asks every alive host without the image to fetch it.
func (s *Service) prefetchEverywhere(ctx context.Context, img store.Image) {
	ctx, cancel := detached(ctx, 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, h := range s.view.aliveHosts() {
		wg.Go(func() { s.prefetchOn(ctx, h, img) })
	}
	wg.Wait()
}

// prefetchOn starts the fetch of img on host unless the host reports it
// ready or fetching. The agent answers at once; the host monitor reads
// the outcome.
func (s *Service) prefetchOn(ctx context.Context, host string, img store.Image) {
	if st, ok := s.view.imageHosts(img.SHA256)[host]; ok && st.Status != agentapi.ImageFailed {
		return
	}
	address, _, ok := s.view.agent(host)
	if !ok {
		return
	}
	src := s.imageSource(img, host)
	c := s.agents.client(address)
	var st agentapi.ImageStatus
	if err := s.agents.call("prefetch_image", func() (err error) { st, err = c.PrefetchImage(ctx, src); return err }); err != nil {
		s.log.Warn("prefetch image", "image", img.Name, "host", host, "err", err)
		return
	}
	s.view.setImage(host, st)
}

// syncPrefetch is the host monitor's part: a host that joined later, or
// whose agent lost its cache, is asked to fetch the prefetch images.
func (s *Service) syncPrefetch(ctx context.Context, host string, cache []agentapi.ImageStatus) {
	s.view.setImages(host, cache)
	imgs, err := s.prefetchImages(ctx)
	if err != nil {
		s.log.Warn("host monitor: read prefetch images", "err", err)
		return
	}
	for _, img := range imgs {
		s.prefetchOn(ctx, host, img)
	}
}

// prefetchImages lists the images with prefetch set (one query per sync
// round, cached for a second so that a round over many hosts reads once).
func (s *Service) prefetchImages(ctx context.Context) ([]store.Image, error) {
	s.prefetchCache.Lock()
	defer s.prefetchCache.Unlock()
	if time.Since(s.prefetchCache.at) < time.Second {
		return s.prefetchCache.imgs, nil
	}
	all, err := s.store.ListImages(ctx, "", 0)
	if err != nil {
		return nil, err
	}
	var out []store.Image
	for _, img := range all {
		if img.Prefetch {
			out = append(out, img)
		}
	}
	s.prefetchCache.imgs, s.prefetchCache.at = out, time.Now()
	return out, nil
}

// prefetchList caches the prefetch images for a moment.
type prefetchList struct {
	sync.Mutex
	imgs []store.Image
	at   time.Time
}

// imageSource is what an agent on host needs to fetch img: the source and,
// first, up to maxPeers alive hosts that hold it ready.
func (s *Service) imageSource(img store.Image, host string) agentapi.ImageSource {
	src := agentapi.ImageSource{Name: img.Name, SHA256: img.SHA256, SourceURL: img.SourceURL, Format: img.Format}
	holders := s.view.imageHosts(img.SHA256)
	for _, h := range slices.Sorted(maps.Keys(holders)) {
		if h == host || holders[h].Status != agentapi.ImageReady {
			continue
		}
		// A peer must prove the key the control plane pinned for it before
		// the agent sends it its token: a host without one is no peer.
		if address, alive, ok := s.view.agent(h); ok && alive {
			if key := s.view.agentKey(h); key != "" {
				src.Peers = append(src.Peers, agentapi.ImagePeer{Address: agentURL(address), PublicKey: key})
			}
		}
		if len(src.Peers) == maxPeers {
			break
		}
	}
	return src
}

// registeredImage returns the registered image of a VM create (nil for a
// built-in image) and refuses a disk below its min_disk_mib.
func (s *Service) registeredImage(ctx context.Context, name string, diskMiB int64) (*store.Image, error) {
	img, err := s.store.GetImage(ctx, name)
	if errors.Is(err, store.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fromStore(err, "read image "+name)
	}
	if diskMiB < img.MinDiskMiB {
		return nil, invalidf("disk_mib %d is below the min_disk_mib %d of image %s; give disk_mib >= %d", diskMiB, img.MinDiskMiB, name, img.MinDiskMiB)
	}
	return &img, nil
}

// apiImage fills an image's per-host status and sizes from the hosts'
// last reports.
func (s *Service) apiImage(img store.Image) api.Image {
	out := api.Image{Name: img.Name, SourceURL: img.SourceURL, SHA256: img.SHA256, Format: img.Format,
		MinDiskMiB: img.MinDiskMiB, Prefetch: img.Prefetch, Firmware: img.Firmware, Hosts: []api.ImageHost{}, CreatedAt: img.CreatedAt}
	hosts := s.view.imageHosts(img.SHA256)
	for _, h := range slices.Sorted(maps.Keys(hosts)) {
		st := hosts[h]
		out.Hosts = append(out.Hosts, api.ImageHost{Host: h, Status: st.Status, Reason: st.Reason})
		if st.Status == agentapi.ImageReady && out.SizeBytes == 0 {
			out.SizeBytes, out.VirtualSizeMiB = st.SizeBytes, st.VirtualSizeMiB
		}
	}
	return out
}

// The host view's part: each host's image cache as its agent last
// reported it (a create or prefetch answer updates it at once).

// setImages replaces a host's image reports.
func (v *hostView) setImages(host string, cache []agentapi.ImageStatus) {
	m := make(map[string]agentapi.ImageStatus, len(cache))
	for _, st := range cache {
		m[st.SHA256] = st
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.images[host] = m
}

// setImage records one image's report of a host.
func (v *hostView) setImage(host string, st agentapi.ImageStatus) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.images[host] == nil {
		v.images[host] = map[string]agentapi.ImageStatus{}
	}
	v.images[host][st.SHA256] = st
}

func (v *hostView) dropImage(host, sha string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	delete(v.images[host], sha)
}

// imageHosts maps each host that reported the image to its status.
func (v *hostView) imageHosts(sha string) map[string]agentapi.ImageStatus {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := map[string]agentapi.ImageStatus{}
	for h, m := range v.images {
		if st, ok := m[sha]; ok {
			out[h] = st
		}
	}
	return out
}

// aliveHosts lists the hosts whose agents answer.
func (v *hostView) aliveHosts() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []string
	for _, h := range v.ix.All() {
		if h.Alive {
			out = append(out, h.Name)
		}
	}
	sort.Strings(out)
	return out
}

// preferLocalLocked applies the image locality preference for a request
// of a registered image; v.mu is held.
func (v *hostView) preferLocalLocked(res scheduler.Result, req scheduler.Request) scheduler.Result {
	if req.ImageSHA256 == "" {
		return res
	}
	holds := map[string]bool{}
	for _, r := range res.Ranked {
		if st, ok := v.images[r.Host][req.ImageSHA256]; ok && st.Status == agentapi.ImageReady {
			holds[r.Host] = true
		}
	}
	res, _ = scheduler.PreferImageLocal(res, v.localMargin, holds)
	return res
}

// imageNote explains the image locality part of a placement, or "" when
// the request's image is not a registered one.
func imageNote(req scheduler.Request, best scheduler.Ranked, runnerUp *scheduler.Ranked, margin float64) string {
	switch {
	case req.ImageSHA256 == "":
		return ""
	case best.ImagePreferred && runnerUp != nil:
		return fmt.Sprintf("image locality decided: host %s already holds image %s and its score %.5f is within %s of the best score %.5f (host %s), which would have to fetch it",
			best.Host, req.Image, best.Score, percent(margin), runnerUp.Score, runnerUp.Host)
	case best.ImageLocal:
		return fmt.Sprintf("host %s already holds image %s: no fetch", best.Host, req.Image)
	}
	return fmt.Sprintf("host %s does not hold image %s yet: it fetches it before the boot", best.Host, req.Image)
}

// joinNotes joins the non-empty notes of a placement.
func joinNotes(notes ...string) string {
	var out []string
	for _, n := range notes {
		if n != "" {
			out = append(out, n)
		}
	}
	return strings.Join(out, "; ")
}

// placementTerms are the score terms of a placement, with image_local
// (1 when the host holds the request's registered image, else 0).
func placementTerms(req scheduler.Request, r scheduler.Ranked) map[string]float64 {
	m := r.Terms.Map()
	if req.ImageSHA256 != "" {
		m["image_local"] = 0
		if r.ImageLocal {
			m["image_local"] = 1
		}
	}
	return m
}

// noteImageOnHost records that host holds img after a VM of it started
// there, with the sizes its agent reports, unless the view knows already.
func (s *Service) noteImageOnHost(ctx context.Context, host string, c *agentapi.Client, img store.Image) {
	if st, ok := s.view.imageHosts(img.SHA256)[host]; ok && st.Status == agentapi.ImageReady {
		return
	}
	st := agentapi.ImageStatus{SHA256: img.SHA256, Name: img.Name, Format: img.Format, Status: agentapi.ImageReady}
	if got, err := c.Image(ctx, img.SHA256); err == nil {
		st = got
	}
	s.view.setImage(host, st)
}

// awaitImage makes the agent of host fetch src (from its peers, else the
// source) unless it holds it, and waits until it is ready or failed. A
// failed image is a 400 with the agent's reason (both digests of a
// mismatch, the format check, a full disk).
func (s *Service) awaitImage(ctx context.Context, c *agentapi.Client, host string, src agentapi.ImageSource) error {
	if st, ok := s.view.imageHosts(src.SHA256)[host]; ok && st.Status == agentapi.ImageReady {
		return nil // the create call finds out if the agent lost it since
	}
	var st agentapi.ImageStatus
	err := s.agents.call("prefetch_image", func() (err error) { st, err = c.PrefetchImage(ctx, src); return err })
	wait := 10 * time.Millisecond
	for err == nil && st.Status == agentapi.ImageFetching {
		select {
		case <-ctx.Done():
			return unavailable(ctx.Err(), "host %s was still fetching image %s when the create's time ran out; retry the create", host, src.Name)
		case <-time.After(wait):
		}
		wait = min(2*wait, 500*time.Millisecond)
		err = s.agents.call("image_status", func() (err error) { st, err = c.Image(ctx, src.SHA256); return err })
	}
	if err != nil {
		return fromAgent(err, host, fmt.Sprintf("fetch image %s", src.Name))
	}
	s.view.setImage(host, st)
	if st.Status == agentapi.ImageFailed {
		return &Error{Code: api.CodeInvalid, Message: fmt.Sprintf("image %s (sha256 %s) failed on host %s: %s", src.Name, src.SHA256, host, st.Reason),
			Details: map[string]any{"image": src.Name, "host": host}}
	}
	return nil
}
