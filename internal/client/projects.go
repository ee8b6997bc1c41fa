package client

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// CreateProject creates a project (admin); ErrConflict when the name is
// taken. It is not retried: a create whose answer was lost shows up as a
// conflict on the retry.
func (c *Client) CreateProject(ctx context.Context, in api.ProjectCreate) (api.Project, error) {
	var out api.Project
	err := c.call(ctx, http.MethodPost, "/v1/projects", in, &out, "", false)
	return out, err
}

// GetProject returns one project with its usage. A project token asking
// for another project gets ErrNotFound, as for an unknown name.
func (c *Client) GetProject(ctx context.Context, name string) (api.Project, error) {
	var out api.Project
	err := c.call(ctx, http.MethodGet, "/v1/projects/"+url.PathEscape(name), nil, &out, "", true)
	return out, err
}

// ListProjects returns one page of projects: every project for a
// fleet-wide token, its own for a project token.
func (c *Client) ListProjects(ctx context.Context, opts ListOptions) (api.List[api.Project], error) {
	var out api.List[api.Project]
	err := c.call(ctx, http.MethodGet, "/v1/projects"+opts.query(), nil, &out, "", true)
	return out, err
}

// AllProjects returns every project the token sees, following pages.
func (c *Client) AllProjects(ctx context.Context) ([]api.Project, error) {
	return all(ctx, func(ctx context.Context, token string) (api.List[api.Project], error) {
		return c.ListProjects(ctx, ListOptions{PageSize: api.MaxPageSize, PageToken: token})
	})
}

// UpdateProject changes a project's description, quotas (all four at
// once) or host labels in place.
func (c *Client) UpdateProject(ctx context.Context, name string, in api.ProjectPatch) (api.Project, error) {
	var out api.Project
	err := c.call(ctx, http.MethodPatch, "/v1/projects/"+url.PathEscape(name), in, &out, "", true)
	return out, err
}

// DeleteProject deletes a project; ErrConflict while it holds VMs, forks
// or networks.
func (c *Client) DeleteProject(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, "/v1/projects/"+url.PathEscape(name), nil, nil, "", true)
}

// QuotaExceeded is what a quota_exceeded answer says: the request would take
// Project past its Limit of Resource (vcpus, memory_mib, disk_mib or vms),
// of which it holds Used and the request asked for Requested more.
type QuotaExceeded struct {
	Project   string
	Resource  string
	Limit     int64
	Used      int64
	Requested int64
}

func (q QuotaExceeded) String() string {
	return fmt.Sprintf("project %q allows %d %s; it holds %d and the request asks for %d more",
		q.Project, q.Limit, q.Resource, q.Used, q.Requested)
}

// QuotaExceededOf returns the details of a quota_exceeded error; false
// for any other error.
func QuotaExceededOf(err error) (QuotaExceeded, bool) {
	var e *Error
	if !errors.As(err, &e) || e.Code != api.CodeQuotaExceeded {
		return QuotaExceeded{}, false
	}
	q := QuotaExceeded{}
	q.Project, _ = e.Details["project"].(string)
	q.Resource, _ = e.Details["resource"].(string)
	q.Limit = detailInt(e.Details["limit"])
	q.Used = detailInt(e.Details["used"])
	q.Requested = detailInt(e.Details["requested"])
	return q, true
}

// detailInt reads a number of an error's details (JSON numbers decode as
// float64).
func detailInt(v any) int64 {
	switch n := v.(type) {
	case float64:
		return int64(n)
	case int64:
		return n
	case int:
		return int64(n)
	}
	return 0
}
