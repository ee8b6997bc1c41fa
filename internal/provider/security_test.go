package provider_test

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
)

// TestAccVM_foreign404KeepsState: a refresh through an endpoint that answers
// 404 without the control API's own not_found error (a wrong path prefix, a
// proxy's HTML page) is an error, and the VM stays in state.
func TestAccVM_foreign404KeepsState(t *testing.T) {
	f := newFleet(t, "h1")
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte("<html><body><h1>404 Not Found</h1></body></html>"))
	}))
	t.Cleanup(proxy.Close)
	good := vmConfig(f, "keep-1", "sim", 1, "")
	withEndpoint := func(endpoint string) string {
		return strings.Replace(good, `"`+f.Control.URL+`"`, `"`+endpoint+`"`, 1)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{Config: good},
			{
				Config:      withEndpoint(f.Control.URL + "/prefix"),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`Unable to Read VM`),
			},
			{
				Config:      withEndpoint(proxy.URL),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`Unable to Read VM`),
			},
			{
				// Still in state: the right endpoint plans nothing.
				Config: good,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionNoop)},
				},
			},
		},
	})
}
