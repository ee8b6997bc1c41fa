package control

import (
	"encoding/base64"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// Page asks for one page of a list.
type Page struct {
	Size  int    // 0 = api.DefaultPageSize
	Token string // next_page_token of the previous page
}

// bounds validates the page and returns the size and the key to start after.
func (p Page) bounds() (int, string, error) {
	size := p.Size
	switch {
	case size == 0:
		size = api.DefaultPageSize
	case size < 0 || size > api.MaxPageSize:
		return 0, "", invalidf("page_size must be between 1 and %d, got %d", api.MaxPageSize, size)
	}
	if p.Token == "" {
		return size, "", nil
	}
	after, err := base64.RawURLEncoding.DecodeString(p.Token)
	if err != nil || len(after) == 0 {
		return 0, "", invalidf("page_token is not one this API returned")
	}
	return size, string(after), nil
}

func pageToken(lastKey string) string { return base64.RawURLEncoding.EncodeToString([]byte(lastKey)) }
