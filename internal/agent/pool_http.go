package agent

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

func (a *Agent) getPool(c echo.Context) error {
	return c.JSON(http.StatusOK, agentapi.PoolList{Items: a.PoolStatus()})
}

func (a *Agent) putPool(c echo.Context) error {
	var put agentapi.PoolPut
	if err := bindJSON(c, &put); err != nil {
		return err
	}
	items, err := a.SetPool(c.Request().Context(), c.Param("image"), put)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, agentapi.PoolList{Items: items})
}
