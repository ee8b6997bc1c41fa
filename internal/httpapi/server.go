// Package httpapi is the HTTP face of the control API (Echo v4): routes,
// bearer authentication, request ids and logs, and the one error handler
// that maps domain errors to statuses and the error envelope.
package httpapi

import (
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
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

	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	// Log the peer address, not a client-supplied X-Forwarded-For.
	e.IPExtractor = echo.ExtractIPDirect()
	e.HTTPErrorHandler = errorHandler(log)
	e.Use(middleware.RequestID())
	e.Use(requestLog(log, requests))
	e.Use(middleware.Recover())
	// "1MiB": Echo reads "1M" as 10^6 bytes, less than MaxBodyBytes.
	e.Use(middleware.BodyLimit("1MiB"))

	h := &handlers{svc: svc}
	e.GET("/healthz", h.healthz)
	e.GET("/readyz", h.readyz)
	var metricsGuard []echo.MiddlewareFunc
	if opts.MetricsToken != "" {
		metricsGuard = append(metricsGuard, metricsAuth(opts.MetricsToken))
	}
	e.GET("/metrics", echo.WrapHandler(promhttp.HandlerFor(svc.Registry(), promhttp.HandlerOpts{})), metricsGuard...)

	toks := newTokens(svc, opts.Token)
	v1 := e.Group("/v1", authenticate(toks))
	v1.PUT("/hosts/:name", h.putHost)
	v1.GET("/hosts", h.listHosts)
	v1.GET("/hosts/:name", h.getHost)
	v1.DELETE("/hosts/:name", h.deleteHost)
	v1.POST("/hosts/:name/retire", h.retireHost)
	v1.POST("/vms", h.createVM)
	v1.GET("/vms", h.listVMs)
	v1.GET("/vms/:id", h.getVM)
	v1.PATCH("/vms/:id", h.updateVM)
	v1.DELETE("/vms/:id", h.deleteVM)
	v1.POST("/placements", h.place)
	v1.POST("/networks", h.createNetwork)
	v1.GET("/networks", h.listNetworks)
	v1.GET("/networks/:name", h.getNetwork)
	v1.PATCH("/networks/:name", h.updateNetwork)
	v1.DELETE("/networks/:name", h.deleteNetwork)
	h.forkRoutes(v1)
	h.imageRoutes(v1)
	v1.POST("/tokens", h.createToken)
	v1.GET("/tokens", h.listTokens)
	v1.DELETE("/tokens/:id", h.revokeToken)
	h.uiRoutes(e, toks, opts.Token)
	return e, nil
}

// requestLog writes the response of a failed handler itself (so that the
// log line has the final status) and logs one JSON line per request:
// 5xx at error with the cause, 4xx at debug, the rest at info.
func requestLog(log *slog.Logger, requests *prometheus.CounterVec) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			start := time.Now()
			err := next(c)
			if err != nil {
				c.Error(err)
			}
			req, res := c.Request(), c.Response()
			requests.WithLabelValues(req.Method, c.Path(), http.StatusText(res.Status)).Inc()
			attrs := []any{
				"request_id", res.Header().Get(echo.HeaderXRequestID),
				"method", req.Method, "path", req.URL.Path, "route", c.Path(),
				"status", res.Status, "duration_ms", float64(time.Since(start).Microseconds()) / 1000,
				"remote", c.RealIP(),
			}
			if p, ok := c.Get(principalKey).(control.Principal); ok {
				attrs = append(attrs, "token", principalName(p))
			}
			switch {
			case res.Status >= 500:
				log.Error("request failed", append(attrs, "err", err)...)
			case res.Status >= 400:
				log.Debug("request refused", append(attrs, "err", err)...)
			default:
				log.Info("request", attrs...)
			}
			return nil
		}
	}
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
	api.CodeIdempotencyMismatch: http.StatusUnprocessableEntity,
	api.CodeInFlight:            http.StatusConflict,
	api.CodeTooLarge:            http.StatusRequestEntityTooLarge,
	api.CodeUnavailable:         http.StatusServiceUnavailable,
	api.CodeInternal:            http.StatusInternalServerError,
}

// errorHandler is the one place where errors become HTTP answers.
func errorHandler(log *slog.Logger) echo.HTTPErrorHandler {
	return func(err error, c echo.Context) {
		if c.Response().Committed {
			return
		}
		body := toEnvelope(err)
		status, ok := statusOf[body.Error.Code]
		if !ok {
			status = http.StatusInternalServerError
		}
		if status >= 500 && body.Error.Code == api.CodeInternal {
			body.Error.Message += "; see the server log for request id " + c.Response().Header().Get(echo.HeaderXRequestID)
		}
		if c.Request().Method == http.MethodHead {
			err = c.NoContent(status)
		} else {
			err = c.JSON(status, body)
		}
		if err != nil {
			log.Error("write error response", "err", err)
		}
	}
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
