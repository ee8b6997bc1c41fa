// Package httpapi is the HTTP face of the control API (Echo v4): routes,
// bearer authentication, request ids and logs, and the one error handler
// that maps domain errors to statuses and the error envelope.
package httpapi

import (
	"crypto/sha256"
	"crypto/subtle"
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
	// Token is the bearer token every /v1 request must carry. Required.
	Token  string
	Logger *slog.Logger
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
	e.GET("/metrics", echo.WrapHandler(promhttp.HandlerFor(svc.Registry(), promhttp.HandlerOpts{})))

	v1 := e.Group("/v1", bearerAuth(opts.Token))
	v1.PUT("/hosts/:name", h.putHost)
	v1.GET("/hosts", h.listHosts)
	v1.GET("/hosts/:name", h.getHost)
	v1.DELETE("/hosts/:name", h.deleteHost)
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
	return e, nil
}

// bearerAuth checks the token in constant time (comparing digests, so not
// even the token's length leaks). A failure says nothing more than that.
func bearerAuth(token string) echo.MiddlewareFunc {
	want := sha256.Sum256([]byte("Bearer " + token))
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			got := sha256.Sum256([]byte(c.Request().Header.Get(echo.HeaderAuthorization)))
			if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
				c.Response().Header().Set(echo.HeaderWWWAuthenticate, `Bearer realm="kvmd"`)
				return &control.Error{Code: api.CodeUnauthorized, Message: "unauthorized"}
			}
			return next(c)
		}
	}
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
			return envelope(api.CodeNotFound, "no such route")
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
