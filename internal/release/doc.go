// Package release holds the test of `make release` (scripts/release.sh): the
// provider zips install from a filesystem mirror with the terraform CLI and
// plan the quickstart against a running control API; and the check that
// the README's make demo line promises what scripts/demo.sh does. It has no
// code of its own.
package release
