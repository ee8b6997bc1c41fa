// Package upgradetest holds the version skew tests of kvmd (make
// test-upgrade): it builds the previous release (a pinned commit, built in
// a git worktree and cached outside the clone), this tree, and a build that
// claims an API level nothing serves, and runs mixed fleets of them as
// processes with the sim driver on one PostgreSQL database, driven through
// the control API and through the real terraform CLI with this tree's
// provider. It has no code of its own.
package upgradetest
