package client_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestOnlyTheAPIsOwnNotFoundIsNotFound: a 404 that is not the control API's
// not_found error for the object asked (a route miss behind a wrong path
// prefix, a proxy's HTML page) must not read as "the object is gone", or
// the provider drops live resources from state.
func TestOnlyTheAPIsOwnNotFoundIsNotFound(t *testing.T) {
	c := testenv.StartControl(t, testenv.ControlOptions{})
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte("<html><body><h1>404 Not Found</h1>nginx</body></html>"))
	}))
	t.Cleanup(proxy.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for name, endpoint := range map[string]string{
		"path prefix on the control API": c.URL + "/kvm",
		"proxy answering an HTML 404":    proxy.URL,
	} {
		t.Run(name, func(t *testing.T) {
			cl := client.New(endpoint, c.Token, client.WithRetries(0, 0))
			_, err := cl.GetVM(ctx, "vm-that-may-exist")
			if err == nil || errors.Is(err, client.ErrNotFound) {
				t.Fatalf("GetVM through %s: %v; want an error that is not ErrNotFound", endpoint, err)
			}
			if !errors.Is(err, client.ErrUnexpectedAnswer) {
				t.Errorf("GetVM through %s: %v; want ErrUnexpectedAnswer", endpoint, err)
			}
			if _, err := cl.GetFork(ctx, "f"); err == nil || errors.Is(err, client.ErrNotFound) {
				t.Errorf("GetFork through %s: %v; want an error that is not ErrNotFound", endpoint, err)
			}
			if _, err := cl.GetHost(ctx, "h"); err == nil || errors.Is(err, client.ErrNotFound) {
				t.Errorf("GetHost through %s: %v; want an error that is not ErrNotFound", endpoint, err)
			}
		})
	}

	// The API's own answer for an object it does not have is ErrNotFound.
	if _, err := c.Client.GetVM(ctx, "no-such-vm"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("GetVM of an unknown id on the API itself: %v; want ErrNotFound", err)
	}
	if _, err := c.Client.GetHost(ctx, "no-such-host"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("GetHost of an unknown name on the API itself: %v; want ErrNotFound", err)
	}
}
