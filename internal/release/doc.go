// Package release holds the test of `make release` (scripts/release.sh): the
// provider zips install from a filesystem mirror with the terraform CLI and
// plan the quickstart against a running control API. It has no code of its
// own.
package release
