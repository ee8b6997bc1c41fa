// Package httpserver is the one middleware set of the two Echo servers,
// the control API (internal/httpapi) and the host agent (internal/agent):
// request ids, one request log line with a metric, recovery from panics,
// the body limit, the error envelope written in one place, and bearer
// token checks. Each server keeps only its routes and the mapping of its
// domain errors to a status and an envelope.
package httpserver

import (
	"crypto/sha256"
	"crypto/subtle"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// BodyLimit is the largest request body either server accepts, in Echo's
// notation: "1MiB" (Echo reads "1M" as 10^6 bytes).
const BodyLimit = "1MiB"

// Config is what differs between the servers.
type Config struct {
	// Logger gets one line per request: 5xx at error with the cause, 4xx
	// at debug, the rest at info.
	Logger *slog.Logger
	// Requests counts requests by method, route and code.
	Requests *prometheus.CounterVec
	// CodeLabel is the code label of a status in Requests.
	CodeLabel func(status int) string
	// Envelope maps an error of a handler or a middleware to its status
	// and the error envelope it is answered with.
	Envelope func(c echo.Context, err error) (status int, body any)
	// Caller (optional) names who made the request in its log line,
	// never with a secret.
	Caller func(c echo.Context) (string, bool)
}

// New returns an Echo server with the middleware set: request id, request
// log (which writes a failed handler's answer itself, so its line has the
// final status), recovery from panics, and the body limit.
func New(cfg Config) *echo.Echo {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	// Log the peer address, not a client-supplied X-Forwarded-For.
	e.IPExtractor = echo.ExtractIPDirect()
	e.HTTPErrorHandler = errorHandler(cfg)
	e.Use(middleware.RequestID())
	// Every answer says which kvmd gave it (internal/version).
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			version.SetHeaders(c.Response().Header())
			return next(c)
		}
	})
	e.Use(requestLog(cfg))
	e.Use(middleware.Recover())
	e.Use(middleware.BodyLimit(BodyLimit))
	return e
}

// RequestID is the id of the request that c answers.
func RequestID(c echo.Context) string { return c.Response().Header().Get(echo.HeaderXRequestID) }

func requestLog(cfg Config) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			start := time.Now()
			err := next(c)
			if err != nil {
				c.Error(err)
			}
			req, res := c.Request(), c.Response()
			cfg.Requests.WithLabelValues(req.Method, c.Path(), cfg.CodeLabel(res.Status)).Inc()
			attrs := []any{
				"request_id", RequestID(c),
				"method", req.Method, "path", req.URL.Path, "route", c.Path(),
				"status", res.Status, "duration_ms", float64(time.Since(start).Microseconds()) / 1000,
				"remote", c.RealIP(),
			}
			if cfg.Caller != nil {
				if who, ok := cfg.Caller(c); ok {
					attrs = append(attrs, "token", who)
				}
			}
			switch {
			case res.Status >= 500:
				cfg.Logger.Error("request failed", append(attrs, "err", err)...)
			case res.Status >= 400:
				cfg.Logger.Debug("request refused", append(attrs, "err", err)...)
			default:
				cfg.Logger.Info("request", attrs...)
			}
			return nil
		}
	}
}

// errorHandler is the one place where errors become HTTP answers.
func errorHandler(cfg Config) echo.HTTPErrorHandler {
	return func(err error, c echo.Context) {
		if c.Response().Committed {
			return
		}
		status, body := cfg.Envelope(c, err)
		if c.Request().Method == http.MethodHead {
			err = c.NoContent(status)
		} else {
			err = c.JSON(status, body)
		}
		if err != nil {
			cfg.Logger.Error("write error response", "request_id", RequestID(c), "err", err)
		}
	}
}

// BearerToken is the token of an `Authorization: Bearer <token>` header
// (the scheme exactly as RFC 6750 writes it).
func BearerToken(r *http.Request) (string, bool) {
	secret, ok := strings.CutPrefix(r.Header.Get(echo.HeaderAuthorization), "Bearer ")
	if !ok || secret == "" {
		return "", false
	}
	return secret, true
}

// StaticToken lets a request through when it carries token as its bearer
// token, compared in constant time over digests (so that not even the
// token's length leaks); otherwise it returns refuse(c).
func StaticToken(token string, refuse func(c echo.Context) error) echo.MiddlewareFunc {
	want := sha256.Sum256([]byte(token))
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			secret, ok := BearerToken(c.Request())
			got := sha256.Sum256([]byte(secret))
			if subtle.ConstantTimeCompare(got[:], want[:]) != 1 || !ok {
				return refuse(c)
			}
			return next(c)
		}
	}
}
