package agent

// Overlay networks (agentapi/overlay.go): the control plane pushes, per
// network this host has a VM of, the desired tunnel endpoints and entries;
// the kernel's state is programmed and read back by the network package.
// The routes work with any driver (the sim driver programs real netlink
// too); a driver with host networking of its own (NetworkHoster) shares its
// network.Host, so that a VM's NICs and the pushes never race on a bridge.

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// NetworkHoster is a driver that makes the host side of NICs itself: the
// agent programs overlays through its network.Host.
type NetworkHoster interface {
	Network() *network.Host
}

// setupOverlays picks the network.Host of overlays and gives it the
// underlay address, which must be on one of the host's interfaces.
func (a *Agent) setupOverlays() error {
	if nh, ok := a.cfg.Driver.(NetworkHoster); ok {
		a.overlays = nh.Network()
	} else {
		a.overlays = network.New(a.log)
	}
	if a.cfg.UnderlayAddress == "" {
		return nil
	}
	u, err := network.FindUnderlay(a.cfg.UnderlayAddress)
	if err != nil {
		return err
	}
	a.overlays.SetUnderlay(u)
	a.log.Info("underlay address", "address", u.Addr, "interface", u.Link, "mtu", u.MTU)
	return nil
}

// overlayError maps the network package's overlay errors.
func overlayError(err error) error {
	switch {
	case errors.Is(err, network.ErrNoUnderlay):
		return &Error{Status: http.StatusConflict, Code: CodeConflict,
			Message: "this agent has no underlay address, which overlay networks need: start it with --underlay-address (KVMD_UNDERLAY_ADDRESS) " +
				"set to its IPv4 address on the network between the hosts"}
	case errors.Is(err, network.ErrBadOverlay):
		return errInvalid("%v", err)
	}
	return err
}

func (a *Agent) overlayRoutes(v1 *echo.Group) {
	v1.GET("/overlays", a.listOverlays)
	v1.PUT("/overlays/:network", a.putOverlay)
	v1.DELETE("/overlays/:network", a.deleteOverlay)
}

func (a *Agent) putOverlay(c echo.Context) error {
	var o agentapi.Overlay
	if err := bindJSON(c, &o); err != nil {
		return err
	}
	name := c.Param("network")
	if !networkNamePattern.MatchString(name) {
		return errInvalid("network %q is not a valid network name (1 to 63 letters, digits, '.', '_' or '-')", name)
	}
	if o.Network != name {
		return errInvalid("the body names network %q, the path %q", o.Network, name)
	}
	st, err := a.overlays.PutOverlay(o)
	if err != nil {
		return overlayError(err)
	}
	return c.JSON(http.StatusOK, st)
}

func (a *Agent) deleteOverlay(c echo.Context) error {
	name := c.Param("network")
	if !networkNamePattern.MatchString(name) {
		return errInvalid("network %q is not a valid network name (1 to 63 letters, digits, '.', '_' or '-')", name)
	}
	if err := a.overlays.DeleteOverlay(name); err != nil {
		return fmt.Errorf("delete overlay network %s: %w", name, err)
	}
	return c.NoContent(http.StatusNoContent)
}

func (a *Agent) listOverlays(c echo.Context) error {
	list, err := a.overlays.ListOverlays()
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, list)
}
