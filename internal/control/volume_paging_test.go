package control_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// The volume list pages like the VM list (the same paging helper): by id,
// a token while more follow, none on the last page, also when the last
// page is exactly full.
func TestVolumeListPages(t *testing.T) {
	ctx := ctxT(t)
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "h1", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	var ids []string
	pages := func(size int) ([]string, []int) {
		t.Helper()
		var listed []string
		var lens []int
		token := ""
		for range 10 {
			p, err := c.Client.ListVolumes(ctx, size, token)
			if err != nil {
				t.Fatal(err)
			}
			lens = append(lens, len(p.Items))
			for _, v := range p.Items {
				listed = append(listed, v.ID)
			}
			if token = p.NextPageToken; token == "" {
				break
			}
		}
		return listed, lens
	}
	for i := range 5 {
		v, err := c.Client.CreateVolume(ctx, api.VolumeCreate{Name: fmt.Sprintf("v%d", i), SizeMiB: 10, Host: "h1"})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, v.ID)
	}
	slices.Sort(ids)
	for _, tc := range []struct {
		size int
		lens []int
	}{{2, []int{2, 2, 1}}, {5, []int{5}}, {1, []int{1, 1, 1, 1, 1}}, {10, []int{5}}} {
		listed, lens := pages(tc.size)
		if !slices.Equal(listed, ids) || !slices.Equal(lens, tc.lens) {
			t.Errorf("pages of %d: %v in pages %v; want %v in pages %v", tc.size, listed, lens, ids, tc.lens)
		}
	}
}
