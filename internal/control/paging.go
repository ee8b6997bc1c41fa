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

// listPage answers one page p of a list kept in id or name order: read
// gets the rows after a key (limit: one more than the page, to tell
// whether another follows), key is a row's key, convert makes the page's
// rows wire items (never nil).
func listPage[R, A any](p Page, read func(after string, limit int) ([]R, error), key func(R) string, convert func([]R) ([]A, error)) (api.List[A], error) {
	size, after, err := p.bounds()
	if err != nil {
		return api.List[A]{}, err
	}
	rows, err := read(after, size+1)
	if err != nil {
		return api.List[A]{}, err
	}
	out := api.List[A]{}
	rows, out.NextPageToken = cutPage(rows, size, key)
	if out.Items, err = convert(rows); err != nil {
		return api.List[A]{}, err
	}
	return out, nil
}

// each converts rows one by one (a listPage convert that cannot fail).
func each[R, A any](conv func(R) A) func([]R) ([]A, error) {
	return func(rows []R) ([]A, error) {
		out := make([]A, 0, len(rows))
		for _, r := range rows {
			out = append(out, conv(r))
		}
		return out, nil
	}
}

// cutPage cuts rows, read with a limit of size+1, to one page: a row past
// size means there is a next page, whose token is the last kept row's key.
func cutPage[T any](rows []T, size int, key func(T) string) ([]T, string) {
	if len(rows) <= size {
		return rows, ""
	}
	rows = rows[:size]
	return rows, pageToken(key(rows[size-1]))
}
