package httpapi

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
)

// volumeRoutes are /v1/volumes: disks on one host that outlive their VMs.
// {ref} is a volume's id or its name in the caller's project.
func (h *handlers) volumeRoutes(v1 *echo.Group) {
	v1.POST("/volumes", h.createVolume)
	v1.GET("/volumes", h.listVolumes)
	v1.GET("/volumes/:ref", h.getVolume)
	v1.PATCH("/volumes/:ref", h.updateVolume)
	v1.POST("/volumes/:ref/resize", h.resizeVolume)
	v1.POST("/volumes/:ref/move", h.moveVolume)
	v1.DELETE("/volumes/:ref", h.deleteVolume)
}

func (h *handlers) createVolume(c echo.Context) error {
	var in api.VolumeCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.CreateVolume(c.Request().Context(), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) listVolumes(c echo.Context) error {
	page, err := pageOf(c)
	if err != nil {
		return err
	}
	out, err := h.svc.ListVolumes(c.Request().Context(), control.VolumeQuery{Page: page, Host: c.QueryParam("host")})
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) getVolume(c echo.Context) error {
	out, err := h.svc.GetVolume(c.Request().Context(), c.Param("ref"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) updateVolume(c echo.Context) error {
	var in api.VolumePatch
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.UpdateVolume(c.Request().Context(), c.Param("ref"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) resizeVolume(c echo.Context) error {
	var in api.VolumeResize
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.ResizeVolume(c.Request().Context(), c.Param("ref"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteVolume(c echo.Context) error {
	if err := h.svc.DeleteVolume(c.Request().Context(), c.Param("ref")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}

func (h *handlers) moveVolume(c echo.Context) error {
	var in api.VolumeMove
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.MoveVolume(c.Request().Context(), c.Param("ref"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}
