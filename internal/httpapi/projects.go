package httpapi

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
)

// projectRoutes are /v1/projects: admins manage them; a project token
// reads its own (control.Service.GetProject decides what a caller sees).
func (h *handlers) projectRoutes(v1 *echo.Group) {
	v1.POST("/projects", h.createProject)
	v1.GET("/projects", h.listProjects)
	v1.GET("/projects/:name", h.getProject)
	v1.PATCH("/projects/:name", h.updateProject)
	v1.DELETE("/projects/:name", h.deleteProject)
	v1.GET("/whoami", h.whoami)
}

// whoami answers who the request's token is: its scopes and project.
func (h *handlers) whoami(c echo.Context) error {
	return c.JSON(http.StatusOK, control.WhoAmI(c.Request().Context()))
}

func (h *handlers) createProject(c echo.Context) error {
	var in api.ProjectCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.CreateProject(c.Request().Context(), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) listProjects(c echo.Context) error {
	page, err := pageOf(c)
	if err != nil {
		return err
	}
	out, err := h.svc.ListProjects(c.Request().Context(), page)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) getProject(c echo.Context) error {
	out, err := h.svc.GetProject(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) updateProject(c echo.Context) error {
	var in api.ProjectPatch
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.UpdateProject(c.Request().Context(), c.Param("name"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteProject(c echo.Context) error {
	if err := h.svc.DeleteProject(c.Request().Context(), c.Param("name")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
