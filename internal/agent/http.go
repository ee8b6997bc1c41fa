package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpserver"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

const (
	bodyLimit = httpserver.BodyLimit
	// Console reads: 64 KiB unless ?bytes= asks for another amount, at most 1 MiB.
	consoleDefault = 64 << 10
	consoleMax     = 1 << 20
)

func (a *Agent) routes() http.Handler {
	reg := prometheus.NewRegistry()
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmd_agent_http_requests_total", Help: "HTTP requests by route and status.",
	}, []string{"method", "route", "code"})
	reg.MustRegister(requests, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvmd_agent_vms", Help: "VMs on this agent.",
	}, func() float64 {
		return float64(a.vms.len())
	}))
	e := httpserver.New(httpserver.Config{
		Logger: a.log, Requests: requests, CodeLabel: strconv.Itoa, Envelope: errorAnswer,
	})

	e.GET("/healthz", func(c echo.Context) error {
		return c.JSON(http.StatusOK, map[string]string{"status": "ok"})
	})
	var metricsGuard []echo.MiddlewareFunc
	if a.cfg.MetricsToken != "" {
		metricsGuard = append(metricsGuard, httpserver.StaticToken(a.cfg.MetricsToken, func(echo.Context) error {
			return &Error{Status: http.StatusUnauthorized, Code: CodeUnauthorized,
				Message: "missing or wrong bearer token: send Authorization: Bearer <metrics token> (--metrics-token of the agent)"}
		}))
	}
	e.GET("/metrics", echo.WrapHandler(promhttp.HandlerFor(reg, promhttp.HandlerOpts{})), metricsGuard...)

	// The one /v1 call without a token: how the control plane learns that
	// this address is an agent before it sends the token here.
	e.POST("/v1/identity", a.postIdentity)

	v1 := e.Group("/v1", httpserver.StaticToken(a.cfg.Token, func(echo.Context) error {
		return &Error{Status: http.StatusUnauthorized, Code: CodeUnauthorized,
			Message: "missing or wrong bearer token: send Authorization: Bearer <agent token>"}
	}))
	v1.Use(refuseSkewedCallers)
	v1.GET("/info", a.getInfo)
	v1.GET("/vms", a.listVMs)
	v1.PUT("/vms/:id", a.putVM)
	v1.GET("/vms/:id", a.getVM)
	v1.DELETE("/vms/:id", a.deleteVM)
	v1.PUT("/vms/:id/shape", a.putShape)
	v1.GET("/vms/:id/console", a.getConsole)
	v1.GET("/vms/:id/guest", a.getGuest)
	v1.POST("/vms/:id/:action", a.postAction)
	v1.PUT("/vms/:id/disk", a.putDisk)
	a.migrationRoutes(v1)
	a.snapshotRoutes(v1)
	a.volumeRoutes(v1)
	a.imageRoutes(v1)
	a.overlayRoutes(v1)
	v1.GET("/pool", a.getPool)
	v1.PUT("/pool/:image", a.putPool)
	return e
}

// refuseSkewedCallers answers a caller (the control plane, or a peer
// agent pulling a snapshot or an image) whose kvmd is outside this agent's
// skew contract with an error naming both versions, before the call does
// anything: a spec of a level this agent cannot read is never half read.
// GET /v1/info is served to every caller, so that a control plane learns
// this agent's version and says why it does not use it.
func refuseSkewedCallers(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		peer, err := version.FromHeader(c.Request().Header)
		if err != nil {
			return errInvalid("%v", err)
		}
		if version.Serves(peer.Level) || c.Path() == "/v1/info" {
			return next(c)
		}
		return &Error{Status: http.StatusBadRequest, Code: agentapi.CodeVersionSkew,
			Message: version.SkewError("agent", peer, "caller"),
			Details: map[string]any{"agent_release": version.Release(), "agent_api_level": version.Current(),
				"caller_release": peer.Release, "caller_api_level": peer.Level}}
	}
}

// errorAnswer maps an error to its status and envelope. Domain errors
// carry their status; anything else is a 500 (its cause is in the request
// log line).
func errorAnswer(_ echo.Context, err error) (int, any) {
	body := agentapi.ErrorBody{}
	status := http.StatusInternalServerError
	var de *Error
	var he *echo.HTTPError
	switch {
	case errors.As(err, &de):
		status = de.Status
		body.Error = agentapi.ErrorDetail{Code: de.Code, Message: de.Message, Details: de.Details}
		if status >= 500 && de.Err != nil {
			body.Error.Message = de.Error()
		}
	case errors.As(err, &he):
		status = he.Code
		body.Error = agentapi.ErrorDetail{Code: codeForStatus(status), Message: fmt.Sprint(he.Message)}
	default:
		body.Error = agentapi.ErrorDetail{Code: CodeInternal, Message: err.Error()}
	}
	return status, body
}

func codeForStatus(status int) string {
	switch status {
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		return CodeNotFound
	case http.StatusUnauthorized:
		return CodeUnauthorized
	case http.StatusForbidden:
		return CodeForbidden
	case http.StatusRequestEntityTooLarge:
		return CodeTooLarge
	case http.StatusConflict:
		return CodeConflict
	}
	if status >= 500 {
		return CodeInternal
	}
	return CodeInvalid
}

// bindJSON decodes exactly one JSON value into v and refuses unknown fields.
func bindJSON(c echo.Context, v any) error {
	b, err := io.ReadAll(c.Request().Body)
	if err != nil {
		if errors.Is(err, echo.ErrStatusRequestEntityTooLarge) {
			return &Error{Status: http.StatusRequestEntityTooLarge, Code: CodeTooLarge,
				Message: "request body is larger than " + bodyLimit}
		}
		return errInvalid("read request body: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return errInvalid("request body is not valid JSON for this call: %v", err)
	}
	if dec.More() {
		return errInvalid("request body has data after its JSON value")
	}
	return nil
}

func (a *Agent) getInfo(c echo.Context) error {
	info, err := a.Info(c.Request().Context())
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, info)
}

func (a *Agent) listVMs(c echo.Context) error {
	return c.JSON(http.StatusOK, agentapi.VMList{Items: a.ListVMs(c.Request().Context())})
}

func (a *Agent) putVM(c echo.Context) error {
	start := time.Now()
	ctx, steps := timing.NewContext(c.Request().Context())
	var spec agentapi.VMSpec
	if err := bindJSON(c, &spec); err != nil {
		return err
	}
	vm, created, err := a.CreateVM(ctx, c.Param("id"), spec)
	if err != nil {
		return err
	}
	// handler: the whole create in this process, so that a caller tells it
	// from the network and HTTP around it.
	steps.Add("handler", time.Since(start))
	c.Response().Header().Set("Server-Timing", steps.Header())
	if created {
		return c.JSON(http.StatusCreated, vm)
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) putShape(c echo.Context) error {
	var shape agentapi.VMShape
	if err := bindJSON(c, &shape); err != nil {
		return err
	}
	vm, err := a.ResizeVM(c.Request().Context(), c.Param("id"), shape)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) getVM(c echo.Context) error {
	vm, err := a.GetVM(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) deleteVM(c echo.Context) error {
	ctx, steps := timing.NewContext(c.Request().Context())
	if err := a.DeleteVM(ctx, c.Param("id")); err != nil {
		return err
	}
	c.Response().Header().Set("Server-Timing", steps.Header())
	return c.NoContent(http.StatusNoContent)
}

func (a *Agent) postAction(c echo.Context) error {
	vm, err := a.Action(c.Request().Context(), c.Param("id"), c.Param("action"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, vm)
}

func (a *Agent) getConsole(c echo.Context) error {
	n := int64(consoleDefault)
	if q := c.QueryParam("bytes"); q != "" {
		v, err := strconv.ParseInt(q, 10, 64)
		if err != nil || v < 1 || v > consoleMax {
			return errInvalid("bytes must be a whole number from 1 to %d, got %q", consoleMax, q)
		}
		n = v
	}
	b, err := a.Console(c.Request().Context(), c.Param("id"), n)
	if err != nil {
		return err
	}
	return c.Blob(http.StatusOK, "text/plain; charset=utf-8", b)
}

func (a *Agent) getGuest(c echo.Context) error {
	g, err := a.Guest(c.Request().Context(), c.Param("id"))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, g)
}
