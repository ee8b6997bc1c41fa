package control_test

import (
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Retiring (or deregistering) a host that still has volumes is refused
// with 409 naming them and saying to move or delete them, and changes
// nothing. A delete of a
// volume on the dead host is kept deleting (its agent cannot confirm);
// once every volume is being deleted, the retire goes through and
// finishes those deletes: rows gone, capacity released, names free.
func TestRetireHostWithVolumes(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		gone := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 102400})
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: dbURL, DeadAfter: 1})
		c.RegisterHost(t, "h1", gone.Address)
		var vols []api.Volume
		for _, name := range []string{"pgdata", "cache"} {
			v, err := c.Client.CreateVolume(ctx, api.VolumeCreate{Name: name, SizeMiB: 1000, Host: "h1"})
			if err != nil {
				t.Fatal(err)
			}
			vols = append(vols, v)
		}
		gone.Stop()
		eventually(t, "host h1 marked not alive", func() bool {
			h, err := c.Client.GetHost(ctx, "h1")
			return err == nil && !h.Alive
		})

		_, err := c.Client.RetireHost(ctx, "h1")
		if clientCode(err) != api.CodeConflict {
			t.Fatalf("retire of a host with volumes: %v; want 409 conflict", err)
		}
		for _, v := range vols {
			if !strings.Contains(err.Error(), v.Name) || !strings.Contains(err.Error(), v.ID) {
				t.Errorf("the refusal should name volume %s (%s): %v", v.Name, v.ID, err)
			}
		}
		if !strings.Contains(err.Error(), "move") || !strings.Contains(err.Error(), "delete") {
			t.Errorf("the refusal should say to move or delete the volumes: %v", err)
		}
		h, err := c.Client.GetHost(ctx, "h1")
		if err != nil {
			t.Fatal(err)
		}
		if h.RetiredAt != nil || h.Allocated != (api.Resources{DiskMiB: 2000}) {
			t.Fatalf("a refused retire changed host h1: %+v", h)
		}
		// Deregistering it is refused the same way.
		err = c.Client.DeleteHost(ctx, "h1")
		if clientCode(err) != api.CodeConflict || !strings.Contains(err.Error(), vols[0].ID) {
			t.Fatalf("delete of a host with volumes: %v; want 409 naming volume %s", err, vols[0].ID)
		}
		checkLedger(t, c.Store)

		// Deletes on the dead host are recorded, not finished.
		for _, v := range vols {
			if err := c.Client.DeleteVolume(ctx, v.ID); clientCode(err) != api.CodeUnavailable {
				t.Fatalf("delete volume %s on a dead host: %v; want 503 unavailable", v.Name, err)
			}
		}
		if h, err = c.Client.RetireHost(ctx, "h1"); err != nil {
			t.Fatalf("retire h1 once its volumes are being deleted: %v", err)
		}
		if h.RetiredAt == nil || h.Allocated != (api.Resources{}) {
			t.Fatalf("retired host = %+v; want retired_at set and nothing allocated", h)
		}
		for _, v := range vols {
			if _, err := c.Client.GetVolume(ctx, v.ID); clientCode(err) != api.CodeNotFound {
				t.Errorf("volume %s after the retire: %v; want it gone", v.Name, err)
			}
		}
		checkLedger(t, c.Store)
	})
}

// newUUID is an id no volume has.
func newUUID(t *testing.T) string {
	t.Helper()
	return uuid.NewString()
}
