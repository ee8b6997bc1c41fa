package store

import "gorm.io/gorm"

// keysetPage orders q by column key (a column name of ours, never input)
// and keeps the rows after `after` (the last key of the previous page; ""
// for the first), at most limit of them (0: all): the keyset paging of
// every list.
func keysetPage(q *gorm.DB, key, after string, limit int) *gorm.DB {
	q = q.Order(key)
	if after != "" {
		q = q.Where(key+" > ?", after)
	}
	if limit > 0 {
		q = q.Limit(limit)
	}
	return q
}
