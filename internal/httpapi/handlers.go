package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

type handlers struct{ svc *control.Service }

func (h *handlers) healthz(c echo.Context) error {
	return c.JSON(http.StatusOK, map[string]string{"status": "ok"})
}

// info answers GET /v1/info: this control API's kvmd and the agent API
// levels it serves.
func (h *handlers) info(c echo.Context) error {
	return c.JSON(http.StatusOK, api.Info{Release: version.Release(), APILevel: version.Current(),
		MinAPILevel: version.MinServed(), MaxAPILevel: version.MaxServed()})
}

func (h *handlers) readyz(c echo.Context) error {
	if err := h.svc.Ready(c.Request().Context()); err != nil {
		return &control.Error{Code: api.CodeUnavailable, Message: "database unreachable", Err: err}
	}
	return c.JSON(http.StatusOK, map[string]string{"status": "ready"})
}

func (h *handlers) putHost(c echo.Context) error {
	var in api.HostPut
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.PutHost(c.Request().Context(), c.Param("name"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) getHost(c echo.Context) error {
	out, err := h.svc.GetHost(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) listHosts(c echo.Context) error {
	page, err := pageOf(c)
	if err != nil {
		return err
	}
	out, err := h.svc.ListHosts(c.Request().Context(), page)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteHost(c echo.Context) error {
	if err := h.svc.DeleteHost(c.Request().Context(), c.Param("name")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}

// retireHost is POST /v1/hosts/{name}/retire (admin): the host's agent is
// gone for good; its VMs are marked lost and release their capacity.
func (h *handlers) retireHost(c echo.Context) error {
	out, err := h.svc.RetireHost(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) drainHost(c echo.Context) error {
	out, err := h.svc.DrainHost(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) undrainHost(c echo.Context) error {
	out, err := h.svc.UndrainHost(c.Request().Context(), c.Param("name"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

// migrateVM answers once the VM runs on its new host (synchronous, bounded
// by the control plane's migration timeout); GET /v1/vms/{id} shows the
// migration's progress meanwhile.
func (h *handlers) migrateVM(c echo.Context) error {
	var in api.VMMigrate
	if c.Request().ContentLength != 0 {
		if err := decode(c, &in); err != nil {
			return err
		}
	}
	out, err := h.svc.MigrateVM(c.Request().Context(), c.Param("id"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) createVM(c echo.Context) error {
	ctx, timings := timing.NewContext(c.Request().Context())
	start := time.Now()
	var in api.VMCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	timings.Add("decode", time.Since(start))
	out, err := h.svc.CreateVM(ctx, in, c.Request().Header.Get("Idempotency-Key"))
	if err != nil {
		return err
	}
	c.Response().Header().Set("Server-Timing", timings.Header())
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) getVM(c echo.Context) error {
	out, err := h.svc.GetVM(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

// Console lengths of GET /v1/vms/{id}/console (the agent's own bounds).
const (
	consoleDefaultBytes = 64 << 10
	consoleMaxBytes     = 1 << 20
)

// getVMConsole answers the last bytes of the VM's serial console, read
// from its agent, as plain text.
func (h *handlers) getVMConsole(c echo.Context) error {
	n := int64(consoleDefaultBytes)
	if q := c.QueryParam("bytes"); q != "" {
		v, err := strconv.ParseInt(q, 10, 64)
		if err != nil || v < 1 || v > consoleMaxBytes {
			return &control.Error{Code: api.CodeInvalid,
				Message: fmt.Sprintf("bytes must be a whole number from 1 to %d, got %q", consoleMaxBytes, q)}
		}
		n = v
	}
	out, err := h.svc.VMConsole(c.Request().Context(), c.Param("id"), n)
	if err != nil {
		return err
	}
	return c.Blob(http.StatusOK, "text/plain; charset=utf-8", []byte(out))
}

// getVMGuest answers what the VM's guest reported during its current boot.
func (h *handlers) getVMGuest(c echo.Context) error {
	out, err := h.svc.VMGuest(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) listVMs(c echo.Context) error {
	page, err := pageOf(c)
	if err != nil {
		return err
	}
	q := control.VMQuery{Page: page, Host: c.QueryParam("host"), Name: c.QueryParam("name"),
		Label: c.QueryParam("label"), ForkID: c.QueryParam("fork_id")}
	out, err := h.svc.ListVMs(c.Request().Context(), q)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) updateVM(c echo.Context) error {
	var in api.VMPatch
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.UpdateVM(c.Request().Context(), c.Param("id"), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) deleteVM(c echo.Context) error {
	ctx, timings := timing.NewContext(c.Request().Context())
	if err := h.svc.DeleteVM(ctx, c.Param("id")); err != nil {
		return err
	}
	c.Response().Header().Set("Server-Timing", timings.Header())
	return c.NoContent(http.StatusNoContent)
}

func (h *handlers) place(c echo.Context) error {
	var in api.PlacementRequest
	if err := decode(c, &in); err != nil {
		return err
	}
	out, err := h.svc.Place(c.Request().Context(), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) createToken(c echo.Context) error {
	var in api.TokenCreate
	if err := decode(c, &in); err != nil {
		return err
	}
	p, _ := c.Get(principalKey).(control.Principal)
	if err := mayGrant(p, in.Scopes); err != nil {
		return err
	}
	out, err := h.svc.CreateToken(c.Request().Context(), in)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusCreated, out)
}

func (h *handlers) listTokens(c echo.Context) error {
	page, err := pageOf(c)
	if err != nil {
		return err
	}
	out, err := h.svc.ListTokens(c.Request().Context(), page)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (h *handlers) revokeToken(c echo.Context) error {
	if err := h.svc.RevokeToken(c.Request().Context(), c.Param("id")); err != nil {
		return err
	}
	return c.NoContent(http.StatusNoContent)
}

func pageOf(c echo.Context) (control.Page, error) {
	p := control.Page{Token: c.QueryParam("page_token")}
	if s := c.QueryParam("page_size"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			return p, invalid("page_size must be a whole number, got %q", s)
		}
		p.Size = n
	}
	return p, nil
}

// decode reads one JSON object into dst. Unknown fields, trailing data and
// wrong types are refused with a message that names the problem.
func decode(c echo.Context, dst any) error {
	body, err := io.ReadAll(c.Request().Body)
	if err != nil {
		var he *echo.HTTPError
		if errors.As(err, &he) {
			return he
		}
		return invalid("read request body: %v", err)
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return invalid("request body is empty: send a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return invalid("%s", describeJSONError(err))
	}
	if dec.More() {
		return invalid("request body has data after the JSON object")
	}
	return nil
}

func describeJSONError(err error) string {
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syntax):
		return fmt.Sprintf("malformed JSON at byte %d: %v", syntax.Offset, syntax)
	case errors.As(err, &typ):
		if typ.Field != "" && strings.HasPrefix(typ.Value, "number") && jsonKind(typ.Type.Kind().String()) == "a number" {
			return fmt.Sprintf("field %q must be a whole number within range, got %s", typ.Field, typ.Value)
		}
		if typ.Field != "" {
			return fmt.Sprintf("field %q must be %s, got JSON %s", typ.Field, jsonKind(typ.Type.Kind().String()), typ.Value)
		}
		return fmt.Sprintf("request body must be a JSON object, got JSON %s", typ.Value)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "malformed JSON: the body ends in the middle of a value"
	}
	// encoding/json reports unknown fields as `json: unknown field "x"`.
	return "invalid request body: " + err.Error()
}

func jsonKind(goKind string) string {
	switch goKind {
	case "int", "int64", "int32", "float64", "uint", "uint64":
		return "a number"
	case "string":
		return "a string"
	case "bool":
		return "true or false"
	case "map", "struct":
		return "an object"
	case "slice":
		return "an array"
	}
	return "of another type"
}

func invalid(format string, args ...any) error {
	return &control.Error{Code: api.CodeInvalid, Message: fmt.Sprintf(format, args...)}
}
