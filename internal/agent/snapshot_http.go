package agent

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// snapshotRoutes adds the snapshot calls of the agent API:
//
//	PUT    /v1/snapshots/{id}               take it (idempotent on the id)
//	GET    /v1/snapshots/{id}               its metadata, with its files
//	GET    /v1/snapshots/{id}/files/{name}  one file, for a pull by another agent
//	GET    /v1/snapshots/{id}/volumes/{volume}/content  a volume's frozen point as one qcow2 (volume_fork.go)
//	DELETE /v1/snapshots/{id}               remove it (idempotent; 409 while in use)
func (a *Agent) snapshotRoutes(g *echo.Group) {
	g.PUT("/snapshots/:id", a.putSnapshot)
	g.GET("/snapshots/:id", a.getSnapshot)
	g.GET("/snapshots/:id/files/:file", a.getSnapshotFile)
	g.GET("/snapshots/:id/volumes/:volume/content", a.getSnapshotVolumeContent)
	g.DELETE("/snapshots/:id", a.deleteSnapshot)
}

func (a *Agent) putSnapshot(c echo.Context) error {
	var spec agentapi.SnapshotSpec
	if err := bindJSON(c, &spec); err != nil {
		return err
	}
	s, created, err := a.CreateSnapshot(c.Request().Context(), c.Param("id"), spec)
	if err != nil {
		return err
	}
	if created {
		return c.JSON(http.StatusCreated, s)
	}
	return c.JSON(http.StatusOK, s)
}

func (a *Agent) getSnapshot(c echo.Context) error {
	s, err := a.GetSnapshot(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, s)
}

// sparseContentType is the media type of a RAM image in its sparse form.
const sparseContentType = "application/vnd.kvmd.sparse"

func (a *Agent) getSnapshotFile(c echo.Context) error {
	f, meta, err := a.openSnapshotFile(c.Param("id"), c.Param("file"))
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	h := c.Response().Header()
	if meta.BLAKE3 != "" {
		h.Set("X-Snapshot-File-Blake3", meta.BLAKE3)
	} else {
		h.Set("X-Snapshot-File-Sha256", meta.SHA256)
	}
	if meta.Kind == agentapi.SnapshotFileRAM {
		// The sparse form (sparse.go): its length is known only once sent.
		h.Set(echo.HeaderContentType, sparseContentType)
		c.Response().WriteHeader(http.StatusOK)
		if err := WriteSparse(c.Response(), f, fi.Size()); err != nil {
			// The status is sent: the receiver sees a stream without its
			// end record and rejects it.
			a.log.Warn("send ram image", "snapshot", c.Param("id"), "file", meta.Name, "err", err)
		}
		return nil
	}
	h.Set(echo.HeaderContentType, "application/octet-stream")
	// ServeContent sets the length and answers Range requests.
	http.ServeContent(c.Response(), c.Request(), "", fi.ModTime(), f)
	return nil
}

func (a *Agent) deleteSnapshot(c echo.Context) error {
	if err := a.DeleteSnapshot(c.Request().Context(), c.Param("id")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
