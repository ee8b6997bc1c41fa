package client_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// TestQuotaExceededIsItsOwnError: a 409 quota_exceeded is not a name
// conflict (the provider would look for a VM holding the name), and its
// details come back typed for a diagnostic.
func TestQuotaExceededIsItsOwnError(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		_ = json.NewEncoder(w).Encode(api.ErrorBody{Error: api.ErrorDetail{
			Code: api.CodeQuotaExceeded, Message: "project team-a: vcpus quota exceeded",
			Details: map[string]any{"project": "team-a", "resource": "vcpus", "limit": 1, "used": 0, "requested": 2},
		}})
	}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	_, err := client.New(srv.URL, "t", client.WithRetries(0, 0)).CreateVM(ctx, api.VMCreate{Name: "big", VCPUs: 2}, "")
	if !errors.Is(err, client.ErrQuotaExceeded) {
		t.Fatalf("CreateVM over quota: %v; want ErrQuotaExceeded", err)
	}
	if errors.Is(err, client.ErrConflict) {
		t.Errorf("CreateVM over quota: %v reads as ErrConflict", err)
	}
	q, ok := client.QuotaExceededOf(err)
	want := client.QuotaExceeded{Project: "team-a", Resource: "vcpus", Limit: 1, Used: 0, Requested: 2}
	if !ok || q != want {
		t.Errorf("QuotaExceededOf = %+v, %t; want %+v, true", q, ok, want)
	}
	if _, ok := client.QuotaExceededOf(errors.New("other")); ok {
		t.Error("QuotaExceededOf of another error reports a quota")
	}
}
