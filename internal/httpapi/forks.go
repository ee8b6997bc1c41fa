package httpapi

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// forkRoutes adds the fork calls of the control API (/v1/forks).
func (h *handlers) forkRoutes(g *echo.Group) {
	g.POST("/forks", h.createFork)
	g.GET("/forks/:id", h.getFork)
	g.PATCH("/forks/:id", h.updateFork)
	g.DELETE("/forks/:id", h.deleteFork)
}

func (h *handlers) createFork(c echo.Context) error {
	var in api.ForkCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.CreateFork(c.Request().Context(), in, c.Request().Header.Get("Idempotency-Key"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) getFork(c echo.Context) error {
	out, err := h.svc.GetFork(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) updateFork(c echo.Context) error {
	var in api.ForkPatch
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.UpdateFork(c.Request().Context(), c.Param("id"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteFork(c echo.Context) error {
	if err := h.svc.DeleteFork(c.Request().Context(), c.Param("id")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
