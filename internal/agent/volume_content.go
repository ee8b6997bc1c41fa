package agent

// The source side of a volume move: GET /v1/volumes/{id}/content streams
// the volume as one self-contained qcow2 (its chain of frozen bases
// flattened into it), with the file's sha256 in a header sent before the
// body, so that the pulling agent checks the digest while it writes.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// VolumeExporter is a Volumer that can write a volume as one
// self-contained file (no backing file), for a move to another agent.
type VolumeExporter interface {
	// ExportVolumeDisk writes v as one file at dst; a ReadOnly v is a
	// snapshot's frozen point (files nothing writes, a parent VM may
	// still hold open).
	ExportVolumeDisk(ctx context.Context, v MachineVolume, dst string) error
	// CheckPulledVolumeDisk refuses a file pulled from another agent that
	// is not a plain disk of its own: one that names a backing or data
	// file would make this host's VMs read files of the peer's choosing.
	CheckPulledVolumeDisk(ctx context.Context, path string) error
}

// Header names of GET /v1/volumes/{id}/content.
const (
	HeaderVolumeSHA256  = "X-Volume-Sha256"
	HeaderVolumeSizeMiB = "X-Volume-Size-Mib"
	exportPrefix        = ".export-"
)

func (a *Agent) getVolumeContent(c echo.Context) error {
	ctx := c.Request().Context()
	id := c.Param("id")
	if _, _, err := a.volumeRecordOf(id); err != nil {
		return err
	}
	ex, ok := a.cfg.Driver.(VolumeExporter)
	if !ok {
		return errConflict("the %s driver of this agent cannot export volumes", a.cfg.Driver.Name())
	}
	e, err := a.vols.acquire(ctx, id)
	if err != nil {
		return err
	}
	if e == nil {
		return errVolumeNotFound(id)
	}
	r, corrupt, _ := e.state()
	if corrupt != "" || r == nil {
		e.unlock()
		return errVolumeNotFound(id)
	}
	for _, u := range a.volumeUsers(id) {
		if isUp(u.State) || u.State == agentapi.StateCreating {
			e.unlock()
			return errVolumeAttached(id, u, "a volume moves while no running vm has it; detach it or stop the vm first")
		}
	}
	// The export is a file of its own, in a directory that start-up
	// removes if the agent dies while it exists.
	dir, err := os.MkdirTemp(a.volsDir(), exportPrefix+id+"-")
	if err != nil {
		e.unlock()
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	mv, _ := a.machineVolume(vmVolume{ID: id})
	dst := filepath.Join(dir, volumeDiskFile)
	err = ex.ExportVolumeDisk(ctx, mv, dst)
	size := r.SizeMiB
	e.unlock() // the export is a copy: the volume may change now
	if err != nil {
		return fmt.Errorf("export volume %s: %w", id, err)
	}
	f, err := os.Open(dst)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return fmt.Errorf("digest the export of volume %s: %w", id, err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	hd := c.Response().Header()
	hd.Set(HeaderVolumeSHA256, hex.EncodeToString(h.Sum(nil)))
	hd.Set(HeaderVolumeSizeMiB, strconv.FormatInt(size, 10))
	hd.Set(echo.HeaderContentType, "application/octet-stream")
	hd.Set(echo.HeaderContentLength, strconv.FormatInt(n, 10))
	c.Response().WriteHeader(http.StatusOK)
	if _, err := io.Copy(c.Response(), f); err != nil {
		a.log.Warn("send volume content", "volume", id, "err", err)
	}
	return nil
}

// pullVolume streams volume r from the agent its source names into disk
// (a file of the new volume's partial directory), checking the sha256
// while it writes: the one the control plane gave, else the one the
// source sent. The driver then checks that the file is a plain disk that
// names no other file, and it is grown to the size asked for.
func (a *Agent) pullVolume(ctx context.Context, vd Volumer, r *volumeRecord, disk string) error {
	ex, ok := vd.(VolumeExporter)
	if !ok {
		return errConflict("the %s driver of this agent cannot take volumes from other agents", a.cfg.Driver.Name())
	}
	src := r.Source.Peer
	addr, err := agentapi.CheckAddress(src.Agent)
	if err != nil {
		return errInvalid("source.peer.agent: %v", err)
	}
	key, err := agentapi.DecodeKey(src.PublicKey)
	if err != nil {
		return errInvalid("source.peer.public_key (the identity key the control plane pinned for %s): %v", src.Agent, err)
	}
	if src.Digest != "" && !sha256Pattern.MatchString(src.Digest) {
		return errInvalid("source.peer.digest %q is not a sha256 (64 hex digits)", src.Digest)
	}
	p := &peer{address: addr, key: key}
	c, err := a.peerClient(ctx, p)
	if err != nil {
		return errVolumePull(r.ID, addr, err)
	}
	var (
		body    io.ReadCloser
		sent    string
		sizeMiB int64
	)
	if r.Source.Snapshot != "" {
		body, sent, sizeMiB, err = c.OpenSnapshotVolumeContent(ctx, r.Source.Snapshot, r.Source.Volume)
	} else {
		body, sent, sizeMiB, err = c.OpenVolumeContent(ctx, r.ID)
	}
	if err != nil {
		return errVolumePull(r.ID, addr, err)
	}
	defer func() { _ = body.Close() }()
	want := src.Digest
	switch {
	case want == "":
		want = sent
	case sent != want:
		return errVolumePull(r.ID, addr, fmt.Errorf("it sends content with sha256 %s, the move expects %s", sent, want))
	}
	if sizeMiB > r.SizeMiB {
		e := errInvalid("size_mib %d is smaller than the %d MiB of volume %s on %s", r.SizeMiB, sizeMiB, r.ID, addr)
		e.Details = map[string]any{"size_mib": r.SizeMiB, "source_size_mib": sizeMiB}
		return e
	}
	out, err := os.OpenFile(disk, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(out, h), body)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	got := hex.EncodeToString(h.Sum(nil))
	switch {
	case err != nil:
		return errVolumePull(r.ID, addr, fmt.Errorf("transfer failed after %d bytes: %w", n, err))
	case got != want:
		return errVolumePull(r.ID, addr, fmt.Errorf("content has sha256 %s, want %s: corrupted in transit or changed at the source; refused", got, want))
	}
	if err := ex.CheckPulledVolumeDisk(ctx, disk); err != nil {
		return errVolumePull(r.ID, addr, fmt.Errorf("refused: %w", err))
	}
	if r.SizeMiB > sizeMiB {
		return vd.ResizeVolumeDisk(ctx, disk, r.SizeMiB)
	}
	return nil
}

// errVolumePull is the error of a volume pull that failed because of the
// other agent or the transfer (a 502: retrying may help; nothing is kept).
func errVolumePull(id, address string, err error) *Error {
	return &Error{Status: http.StatusBadGateway, Code: CodeUnavailable,
		Message: fmt.Sprintf("pull volume %s from agent %s failed", id, address), Err: err}
}
