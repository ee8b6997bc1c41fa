package agent

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// volumeRoutes adds the volume calls of the agent API:
//
//	PUT    /v1/volumes/{id}              create (idempotent on the id): 201, 200 same spec, 409 another
//	GET    /v1/volumes                   every volume
//	GET    /v1/volumes/{id}              one volume (404 unknown)
//	DELETE /v1/volumes/{id}              204 (unknown too); 409 volume_attached
//	POST   /v1/volumes/{id}/resize       grow (online when attached); smaller: 400
//	GET    /v1/volumes/{id}/content      the volume as one qcow2, sha256 in X-Volume-Sha256 (volume_content.go)
//	PUT    /v1/vms/{vm}/volumes/{id}     attach {read_only} (hot when the vm runs)
//	DELETE /v1/vms/{vm}/volumes/{id}     detach (hot); 204 also when not attached
func (a *Agent) volumeRoutes(g *echo.Group) {
	g.GET("/volumes", a.listVolumes)
	g.PUT("/volumes/:id", a.putVolume)
	g.GET("/volumes/:id", a.getVolume)
	g.DELETE("/volumes/:id", a.deleteVolume)
	g.POST("/volumes/:id/resize", a.postVolumeResize)
	g.GET("/volumes/:id/content", a.getVolumeContent)
	g.PUT("/vms/:id/volumes/:volume", a.putVMVolume)
	g.DELETE("/vms/:id/volumes/:volume", a.deleteVMVolume)
}

func (a *Agent) listVolumes(c echo.Context) error {
	return c.JSON(http.StatusOK, agentapi.VolumeList{Items: a.ListVolumes(c.Request().Context())})
}

func (a *Agent) putVolume(c echo.Context) error {
	var spec agentapi.VolumeSpec
	if err := bindJSON(c, &spec); err != nil {
		return err
	}
	v, created, err := a.CreateVolume(c.Request().Context(), c.Param("id"), spec)
	if err != nil {
		return err
	}
	if created {
		return c.JSON(http.StatusCreated, v)
	}
	return c.JSON(http.StatusOK, v)
}

func (a *Agent) getVolume(c echo.Context) error {
	v, err := a.GetVolume(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, v)
}

func (a *Agent) deleteVolume(c echo.Context) error {
	if err := a.DeleteVolume(c.Request().Context(), c.Param("id")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}

func (a *Agent) postVolumeResize(c echo.Context) error {
	var in agentapi.VolumeResize
	if err := bindJSON(c, &in); err != nil {
		return err
	}
	v, err := a.ResizeVolume(c.Request().Context(), c.Param("id"), in.SizeMiB)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, v)
}

func (a *Agent) putVMVolume(c echo.Context) error {
	var in agentapi.VolumeAttachment
	if err := bindJSON(c, &in); err != nil {
		return err
	}
	if in.ID != "" && in.ID != c.Param("volume") {
		return errInvalid("body id %q differs from the path's volume %q: leave it out", in.ID, c.Param("volume"))
	}
	vm, err := a.AttachVolume(c.Request().Context(), c.Param("id"), c.Param("volume"), in.ReadOnly)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) deleteVMVolume(c echo.Context) error {
	if err := a.DetachVolume(c.Request().Context(), c.Param("id"), c.Param("volume")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
