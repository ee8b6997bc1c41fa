package httpapi

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

func (h *handlers) createNetwork(c echo.Context) error {
	var in api.NetworkCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.CreateNetwork(c.Request().Context(), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) listNetworks(c echo.Context) error {
	out, err := h.svc.ListNetworks(c.Request().Context())
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) getNetwork(c echo.Context) error {
	out, err := h.svc.GetNetwork(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) updateNetwork(c echo.Context) error {
	var in api.NetworkPatch
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.UpdateNetwork(c.Request().Context(), c.Param("name"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteNetwork(c echo.Context) error {
	if err := h.svc.DeleteNetwork(c.Request().Context(), c.Param("name")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
