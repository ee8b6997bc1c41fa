// Package faulttest holds the fault-injection tests of the control plane:
// kvmd control killed with SIGKILL in the middle of creates, agents that
// hang, fail or drop connections, PostgreSQL restarted under load, and two
// replicas racing for capacity. Every test ends by checking the ledger:
// no host over capacity, each host's allocation equal to its VM rows, and
// the rows and the agents' VMs in agreement.
package faulttest
