package httpapi

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// vmVolumeRoutes are a VM's volumes: hot attach and detach.
//
//	POST   /v1/vms/{id}/volumes            {volume, read_only?}: 200 with the VM (also when it has it already)
//	DELETE /v1/vms/{id}/volumes/{volume}   204, also when the volume is not attached to the VM
//
// {volume} is a volume's id or its name in the VM's project.
func (h *handlers) vmVolumeRoutes(v1 *echo.Group) {
	v1.POST("/vms/:id/volumes", h.attachVMVolume)
	v1.DELETE("/vms/:id/volumes/:volume", h.detachVMVolume)
}

func (h *handlers) attachVMVolume(c echo.Context) error {
	var in api.VMVolumeAttach
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.AttachVolume(c.Request().Context(), c.Param("id"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) detachVMVolume(c echo.Context) error {
	if err := h.svc.DetachVolume(c.Request().Context(), c.Param("id"), c.Param("volume")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
