package agent

import (
	"slices"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

func TestParseGuestStatus(t *testing.T) {
	const digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	debianDone := "Cloud-init v. 22.4.2 running 'init-local' at Mon, 30 Nov 2026 15:00:00 +0000. Up 9.1 seconds.\r\n" +
		"ci-info: |  eth0  | True |  10.0.2.15  | 255.255.255.0 | global | 52:54:00:12:34:56 |\r\n" +
		"ci-info: |   lo   | True |  127.0.0.1  |   255.0.0.0   |  host  |         .         |\r\n" +
		"Cloud-init v. 22.4.2 finished at Mon, 30 Nov 2026 15:01:00 +0000. Datasource DataSourceNoCloud [seed=/dev/vdb][dsmode=net].  Up 70.2 seconds\r\n"
	tests := []struct {
		name    string
		console string
		want    agentapi.GuestStatus
	}{
		{"nothing", "tick 1\n", agentapi.GuestStatus{CloudInit: "none", IPv4Addresses: []string{}}},
		{"debian running", "Cloud-init v. 22.4.2 running 'init-local' at Mon, 30 Nov 2026\r\n",
			agentapi.GuestStatus{CloudInit: "running", IPv4Addresses: []string{}}},
		{"debian done", debianDone, agentapi.GuestStatus{CloudInit: "done", IPv4Addresses: []string{"10.0.2.15"}}},
		{"debian failed module", debianDone + "[  71.0] cloud-init[812]: 2026-11-30 15:01:00,000 - cc_scripts_user.py[WARNING]: Failed to run module scripts_user (scripts in /var/lib/cloud/instance/scripts)\r\n",
			agentapi.GuestStatus{CloudInit: "error", IPv4Addresses: []string{"10.0.2.15"}}},
		{"busybox", "kvm-guest-ready\nkvm-guest-hostname web-1\nkvm-guest-userdata-sha256 " + digest +
			"\nCloud-init v. kvm-busybox finished at Mon, 30 Nov 2026 15:00:00 +0000. Datasource NoCloud.\nkvm-guest-ip 10.0.2.15\nkvm-guest-ip 10.0.2.15\n",
			agentapi.GuestStatus{CloudInit: "done", IPv4Addresses: []string{"10.0.2.15"}, Hostname: "web-1", UserDataSHA256: digest}},
		{"a line still being written does not count", "kvm-guest-ready\nkvm-guest-hostname web-1\nkvm-guest-ip 10.77.0.10\nkvm-guest-hostname web-12",
			agentapi.GuestStatus{CloudInit: "none", IPv4Addresses: []string{"10.77.0.10"}, Hostname: "web-1"}},
		{"an address still being written does not count", "kvm-guest-ready\nkvm-guest-ip 10.77.0.1",
			agentapi.GuestStatus{CloudInit: "none", IPv4Addresses: []string{}}},
		{"only the current boot counts", "kvm-guest-hostname old\nCloud-init v. kvm-busybox finished at x. Datasource NoCloud.\nkvm-guest-ip 10.0.2.15\n\r\n" +
			ConsoleBootMarker + "vm-1 at 2026-11-30T15:00:00Z\r\nkvm-guest-ready\n",
			agentapi.GuestStatus{CloudInit: "none", IPv4Addresses: []string{}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := parseGuestStatus(tt.console)
			if got.CloudInit != tt.want.CloudInit || !slices.Equal(got.IPv4Addresses, tt.want.IPv4Addresses) ||
				got.Hostname != tt.want.Hostname || got.UserDataSHA256 != tt.want.UserDataSHA256 {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}
