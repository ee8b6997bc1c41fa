package store

// MigrationVersions lists the versions of the embedded migrations (for tests).
func MigrationVersions() ([]int, error) {
	all, err := migrations()
	if err != nil {
		return nil, err
	}
	var v []int
	for _, m := range all {
		v = append(v, m.version)
	}
	return v, nil
}
