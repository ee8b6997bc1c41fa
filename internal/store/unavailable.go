package store

import (
	"database/sql/driver"
	"errors"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// IsUnavailable reports whether err means that the database could not be
// reached or cut the session (a restart, a failover, a network fault), as
// opposed to a statement it refused: the same call may succeed once the
// database is back, so callers answer "unavailable, retry", not "internal".
func IsUnavailable(err error) bool {
	if err == nil {
		return false
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.As(err, &ce), errors.As(err, &ne), errors.Is(err, driver.ErrBadConn):
		return true
	}
	// Class 08: connection exception; 57P01-57P03: the server is shutting
	// down, crashed or is starting up.
	code := pgCode(err)
	return strings.HasPrefix(code, "08") || code == "57P01" || code == "57P02" || code == "57P03"
}
