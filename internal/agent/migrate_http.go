package agent

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// migrationRoutes are the migration calls: the target's (incoming) and the
// source's (migrate, migration).
func (a *Agent) migrationRoutes(v1 *echo.Group) {
	v1.PUT("/vms/:id/incoming", a.putIncoming)
	v1.POST("/vms/:id/incoming/commit", a.postIncomingCommit)
	v1.GET("/vms/:id/incoming/stream", a.getIncomingStream)
	v1.POST("/vms/:id/migrate", a.postMigrate)
	v1.GET("/vms/:id/migration", a.getMigration)
	v1.DELETE("/vms/:id/migration", a.deleteMigration)
}

func (a *Agent) putIncoming(c echo.Context) error {
	var in agentapi.IncomingSpec
	if err := bindJSON(c, &in); err != nil {
		return err
	}
	vm, created, err := a.PutIncoming(c.Request().Context(), c.Param("id"), in)
	if err != nil {
		return err
	}
	if created {
		return c.JSON(http.StatusCreated, vm)
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) postIncomingCommit(c echo.Context) error {
	var body agentapi.IncomingCommit
	if c.Request().ContentLength != 0 {
		if err := bindJSON(c, &body); err != nil {
			return err
		}
	}
	vm, err := a.CommitIncoming(c.Request().Context(), c.Param("id"), body.Paused)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) postMigrate(c echo.Context) error {
	var spec agentapi.MigrateSpec
	if err := bindJSON(c, &spec); err != nil {
		return err
	}
	mig, err := a.MigrateVM(c.Request().Context(), c.Param("id"), spec)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusAccepted, mig)
}

func (a *Agent) getMigration(c echo.Context) error {
	mig, err := a.GetMigration(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, mig)
}

func (a *Agent) deleteMigration(c echo.Context) error {
	if err := a.CancelMigration(c.Request().Context(), c.Param("id")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}
