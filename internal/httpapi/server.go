// Package httpapi is the HTTP face of the control API (Echo v4): routes,
// bearer authentication, request ids and logs, and the one error handler
// that maps domain errors to statuses and the error envelope.
package httpapi

import (
	"errors"
	"log/slog"
	"net/http"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpserver"
)

// MaxBodyBytes is the largest request body accepted (1 MiB).
const MaxBodyBytes = 1 << 20

// Options configure the HTTP API.
type Options struct {
	// Token is the bootstrap token (kvmd control --token): every scope.
	// Required. Tokens from the database (POST /v1/tokens) work beside it.
	Token string
	// MetricsToken, when set, is the bearer token /metrics requires;
	// empty leaves /metrics open (for a scraper on a trusted network).
	MetricsToken string
	Logger       *slog.Logger
}

// New returns the HTTP handler of the control API on svc. Its metrics go
// to svc.Registry(), so several instances can live in one process.
func New(svc *control.Service, opts Options) (http.Handler, error) {
	if opts.Token == "" {
		return nil, errors.New("httpapi: an API token is required")
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmd_http_requests_total", Help: "HTTP requests by method, route and status.",
	}, []string{"method", "route", "code"})
	if err := svc.Registry().Register(requests); err != nil {
		return nil, err
	}

	e := httpserver.New(httpserver.Config{
		Logger:    log,
		Requests:  requests,
		CodeLabel: http.StatusText,
		Envelope:  errorAnswer,
		Caller: func(c echo.Context) (string, bool) {
			p, ok := c.Get(principalKey).(control.Principal)
			return principalName(p), ok
		},
	})

	h := &handlers{svc: svc}
	e.GET("/healthz", h.healthz)
	e.GET("/readyz", h.readyz)
	var metricsGuard []echo.MiddlewareFunc
	if opts.MetricsToken != "" {
		metricsGuard = append(metricsGuard, httpserver.StaticToken(opts.MetricsToken, unauthorized))
	}
	e.GET("/metrics", echo.WrapHandler(promhttp.HandlerFor(svc.Registry(), promhttp.HandlerOpts{})), metricsGuard...)

	toks := newTokens(svc, opts.Token)
	v1 := e.Group("/v1", authenticate(toks))
	v1.GET("/info", h.info)
	v1.PUT("/hosts/:name", h.putHost)
	v1.GET("/hosts", h.listHosts)
	v1.GET("/hosts/:name", h.getHost)
	v1.DELETE("/hosts/:name", h.deleteHost)
	v1.POST("/hosts/:name/retire", h.retireHost)
	v1.POST("/hosts/:name/drain", h.drainHost)
	v1.POST("/hosts/:name/undrain", h.undrainHost)
	v1.POST("/vms", h.createVM)
	v1.GET("/vms", h.listVMs)
	v1.GET("/vms/:id", h.getVM)
	v1.GET("/vms/:id/console", h.getVMConsole)
	v1.GET("/vms/:id/guest", h.getVMGuest)
	v1.PATCH("/vms/:id", h.updateVM)
	v1.DELETE("/vms/:id", h.deleteVM)
	v1.POST("/vms/:id/migrate", h.migrateVM)
	v1.POST("/placements", h.place)
	v1.POST("/networks", h.createNetwork)
	v1.GET("/networks", h.listNetworks)
	v1.GET("/networks/:name", h.getNetwork)
	v1.PATCH("/networks/:name", h.updateNetwork)
	v1.DELETE("/networks/:name", h.deleteNetwork)
	h.forkRoutes(v1)
	h.imageRoutes(v1)
	h.projectRoutes(v1)
	h.volumeRoutes(v1)
	h.vmVolumeRoutes(v1)
	v1.POST("/tokens", h.createToken)
	v1.GET("/tokens", h.listTokens)
	v1.DELETE("/tokens/:id", h.revokeToken)
	h.uiRoutes(e, toks, opts.Token)
	return e, nil
}

// statusOf maps an error code of the envelope to its HTTP status.
var statusOf = map[string]int{
	api.CodeInvalid:             http.StatusBadRequest,
	api.CodeUnauthorized:        http.StatusUnauthorized,
	api.CodeNotFound:            http.StatusNotFound,
	api.CodeNoRoute:             http.StatusNotFound,
	api.CodeForbidden:           http.StatusForbidden,
	api.CodeConflict:            http.StatusConflict,
	api.CodeNoCapacity:          http.StatusConflict,
	api.CodeNoAddress:           http.StatusConflict,
	api.CodeQuotaExceeded:       http.StatusConflict,
	api.CodeVolumeAttached:      http.StatusConflict,
	api.CodeIdempotencyMismatch: http.StatusUnprocessableEntity,
	api.CodeInFlight:            http.StatusConflict,
	api.CodeTooLarge:            http.StatusRequestEntityTooLarge,
	api.CodeUnavailable:         http.StatusServiceUnavailable,
	api.CodeInternal:            http.StatusInternalServerError,
	api.CodeVersionSkew:         http.StatusConflict,
}

// errorAnswer maps an error to its status and envelope: the one place
// where the control API's errors become HTTP answers.
func errorAnswer(c echo.Context, err error) (int, any) {
	body := toEnvelope(err)
	status, ok := statusOf[body.Error.Code]
	if !ok {
		status = http.StatusInternalServerError
	}
	if status >= 500 && body.Error.Code == api.CodeInternal {
		body.Error.Message += "; see the server log for request id " + httpserver.RequestID(c)
	}
	return status, body
}

func toEnvelope(err error) api.ErrorBody {
	var ce *control.Error
	if errors.As(err, &ce) {
		return api.ErrorBody{Error: api.ErrorDetail{Code: ce.Code, Message: ce.Message, Details: ce.Details}}
	}
	var he *echo.HTTPError
	if errors.As(err, &he) {
		switch he.Code {
		case http.StatusNotFound:
			return envelope(api.CodeNoRoute, "no such route: check the endpoint URL (a path prefix or a proxy in front of kvmd control)")
		case http.StatusMethodNotAllowed:
			return envelope(api.CodeInvalid, "method not allowed on this route")
		case http.StatusRequestEntityTooLarge:
			return envelope(api.CodeTooLarge, "request body is larger than 1 MiB")
		case http.StatusUnauthorized:
			return envelope(api.CodeUnauthorized, "unauthorized")
		}
		if he.Code >= 400 && he.Code < 500 {
			return envelope(api.CodeInvalid, http.StatusText(he.Code))
		}
	}
	return envelope(api.CodeInternal, "internal error")
}

func envelope(code, msg string) api.ErrorBody {
	return api.ErrorBody{Error: api.ErrorDetail{Code: code, Message: msg}}
}
