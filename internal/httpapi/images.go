package httpapi

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// imageRoutes are /v1/images: registered images and their per-host state.
func (h *handlers) imageRoutes(v1 *echo.Group) {
	v1.POST("/images", h.createImage)
	v1.GET("/images", h.listImages)
	v1.GET("/images/:name", h.getImage)
	v1.PATCH("/images/:name", h.updateImage)
	v1.DELETE("/images/:name", h.deleteImage)
}

func (h *handlers) createImage(c echo.Context) error {
	var in api.ImageCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.CreateImage(c.Request().Context(), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) listImages(c echo.Context) error {
	page, err := pageOf(c)
	if err != nil {
		return err
	}
	out, err := h.svc.ListImages(c.Request().Context(), page)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) getImage(c echo.Context) error {
	out, err := h.svc.GetImage(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) updateImage(c echo.Context) error {
	var in api.ImagePatch
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.UpdateImage(c.Request().Context(), c.Param("name"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteImage(c echo.Context) error {
	if err := h.svc.DeleteImage(c.Request().Context(), c.Param("name")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
