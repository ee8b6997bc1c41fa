package store_test

import (
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

func TestIsUnavailable(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"plain", errors.New("syntax error"), false},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false},
		{"admin shutdown", fmt.Errorf("insert: %w", &pgconn.PgError{Code: "57P01"}), true},
		{"starting up", &pgconn.PgError{Code: "57P03"}, true},
		{"connection failure", &pgconn.PgError{Code: "08006"}, true},
		{"refused", fmt.Errorf("dial: %w", &net.OpError{Op: "dial", Err: errors.New("connection refused")}), true},
		{"bad conn", fmt.Errorf("query: %w", driver.ErrBadConn), true},
	} {
		if got := store.IsUnavailable(tc.err); got != tc.want {
			t.Errorf("%s: IsUnavailable(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}
