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
	ExportVolumeDisk(ctx context.Context, v MachineVolume, dst string) error
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
