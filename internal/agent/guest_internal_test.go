package agent

import (
	"regexp"
	"slices"
	"strings"
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

// Console lines as cloud-init prints them on the serial console: journald
// forwards a stage unit's output (StandardOutput=journal+console) with the
// kernel time and "cloud-init[pid]: ", and cloud-init's console log handler
// (config/cloud.cfg.d/05_logging.cfg: level WARNING, to stderr) prefixes
// "<time> - <file>[<LEVEL>]: ". Debian 12 ships 22.4.2; Ubuntu 24.04's line
// is represented by 24.4.1 (wordings unchanged through 25.3).
const (
	ci22 = "[   61.204512] cloud-init[376]: 2026-12-03 07:18:15,532 - "
	ci24 = "[   38.112233] cloud-init[712]: 2026-12-03 07:18:15,532 - "
	// ci22Raw is a line cloud-init writes to stderr without its log format.
	ci22Raw = "[   80.402211] cloud-init[423]: "
)

// colour is a colour escape of systemd's status lines.
var colour = regexp.MustCompile("\x1b\\[[0-9;]*m")

// TestParseGuestStatusCloudInitFailures: one real console line per wording
// that cloud-init prints when `cloud-init status` will say error makes the
// guest status error, even when the final "finished" line follows (as it
// does: a failed module does not stop cloud-init), and the line is reported.
// Source: file:line in cloud-init's tag.
func TestParseGuestStatusCloudInitFailures(t *testing.T) {
	const finished = "[  125.810031] cloud-init[512]: Cloud-init v. 22.4.2 finished at Thu, 03 Dec 2026 07:19:02 +0000. " +
		"Datasource DataSourceNoCloud [seed=/dev/vdb][dsmode=net].  Up 125.51 seconds\r\n"
	tests := []struct {
		name, source, line string
	}{
		{"module failed, 22.4", "22.4.2 config/modules.py:255 via util.py:1707 logexc",
			ci22 + "util.py[WARNING]: Running module write-files (<module 'cloudinit.config.cc_write_files' from " +
				"'/usr/lib/python3/dist-packages/cloudinit/config/cc_write_files.py'>) failed"},
		{"module failed, 24.4", "24.4.1 config/modules.py:307 via log/log_util.py:13 logexc",
			ci24 + "log_util.py[WARNING]: Running module runcmd (<module 'cloudinit.config.cc_runcmd' from " +
				"'/usr/lib/python3/dist-packages/cloudinit/config/cc_runcmd.py'>) failed"},
		{"user scripts failed", "22.4.2 config/cc_scripts_user.py:57, 24.4.1 :41",
			ci22 + "cc_scripts_user.py[WARNING]: Failed to run module scripts_user (scripts in /var/lib/cloud/instance/scripts)"},
		{"vendor scripts failed", "22.4.2 config/cc_scripts_vendor.py:82, 24.4.1 :43",
			ci24 + "cc_scripts_vendor.py[WARNING]: Failed to run module scripts_vendor (vendor in /var/lib/cloud/instance/scripts/vendor)"},
		{"per-boot scripts failed", "22.4.2 config/cc_scripts_per_boot.py:54, 24.4.1 :42",
			ci22 + "cc_scripts_per_boot.py[WARNING]: Failed to run module scripts_per_boot (per-boot in /var/lib/cloud/scripts/per-boot)"},
		{"runparts failed, before 20.3", "20.2 util.py:880 runparts logexc",
			ci22 + "util.py[WARNING]: Failed running /var/lib/cloud/instance/scripts/runcmd [127]"},
		{"busybox script failed", "scripts/build-image.sh: the busybox guest prints the 20.2 form",
			"kvm-busybox cloud-init[1]: util.py[WARNING]: Failed running /tmp/user-data [3]"},
		{"single module failed", "22.4.2 cmd/main.py:680, 24.4.1 :832",
			ci22 + "main.py[WARNING]: Ran write_files but it failed!"},
		{"no datasource, 22.4", "22.4.2 cmd/main.py:403 logexc (stage error: main.py:411)",
			ci22 + "util.py[WARNING]: No instance datasource found! Likely bad things to come!"},
		{"no datasource, 24.4", "24.4.1 cmd/main.py:529 logexc",
			ci24 + "log_util.py[WARNING]: No instance datasource found! Likely bad things to come!"},
		{"stage without datasource, logged", "22.4.2 cmd/main.py:586 logexc, 24.4.1 :730",
			ci22 + "util.py[WARNING]: Can not apply stage config, no datasource found! Likely bad things to come!"},
		{"stage without datasource, printed", "22.4.2 cmd/main.py:590 print_exc, 24.4.1 :734",
			ci22Raw + "Can not apply stage final, no datasource found! Likely bad things to come!"},
		{"single module without datasource", "22.4.2 cmd/main.py:641, 24.4.1 :794",
			ci22 + "util.py[WARNING]: Failed to fetch your datasource, likely bad things to come!"},
		{"user data not consumed", "22.4.2 cmd/main.py:475, 24.4.1 :617",
			ci22 + "util.py[WARNING]: Consuming user data failed!"},
		{"stage raised, 22.4 logged", "22.4.2 cmd/main.py:778 logexc",
			ci22 + "util.py[WARNING]: failed stage init"},
		{"stage raised, 24.4 logged", "24.4.1 cmd/main.py:939 LOG.exception",
			ci24 + "main.py[ERROR]: failed stage modules-config"},
		{"stage raised, printed", "22.4.2 cmd/main.py:779 print_exc, 24.4.1 :940",
			ci22Raw + "failed run of stage modules-final"},
		{"fallback datasource", "22.4.2 config/cc_final_message.py:64, 24.4.1 :33: the seed was not read",
			ci22Raw + "Cloud-init v. 22.4.2 finished at Thu, 03 Dec 2026 07:19:02 +0000. Datasource DataSourceNone.  Up 125.51 seconds"},
		{"stage unit failed, systemd 252", "22.4.2 stage exit code = its error count; Debian 12's systemd",
			"[\x1b[0;1;31mFAILED\x1b[0m] Failed to start \x1b[0;1;39mcloud-init.service\x1b[0m - Initial cloud-init job (metadata service crawler)."},
		{"stage unit failed, name cut", "systemd shortens unit - description to the console width (a Debian 12 guest's line)",
			"[\x1b[0;1;31mFAILED\x1b[0m] Failed to start \x1b[0;1;39mcloud-init…it job (metadata service crawler)."},
		{"stage unit failed, 24.4", "24.4.1 cmd/status.py:316 systemd_failed: a failed stage unit is error",
			"[FAILED] Failed to start cloud-final.service - Cloud-init: Final Stage."},
		{"stage unit failed, systemd before 249", "Ubuntu 20.04's systemd prints the description alone",
			"[FAILED] Failed to start Execute cloud user/final scripts."},
		{"stage unit failed, kernel log", "systemd logs through /dev/kmsg until journald runs",
			"[   21.904113] systemd[1]: Failed to start cloud-init-local.service - Initial cloud-init job (pre-networking)."},
		{"single process stage raised, 24.4", "24.4.1 socket.py:145, echoed by the stage unit's shell",
			"[   45.118877] sh[901]: fatal error, run \"systemctl status cloud-init-main.service\" and \"cloud-init status --long\" for more details"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := parseGuestStatus(tt.line + "\r\n" + finished)
			if got.CloudInit != agentapi.CloudInitError {
				t.Fatalf("cloud-init state %q, want error, for the line (%s):\n%q", got.CloudInit, tt.source, tt.line)
			}
			// The line is reported as it reads, without systemd's colours.
			want := strings.TrimSpace(colour.ReplaceAllString(tt.line, ""))
			if len(got.CloudInitErrors) != 1 || got.CloudInitErrors[0] != want {
				t.Errorf("reported failure lines %q, want [%q]", got.CloudInitErrors, want)
			}
		})
	}
}

// TestParseGuestStatusCloudInitNotFailures: lines that look alarming but
// after which `cloud-init status` still says done (22.4; "degraded done"
// on 24.4, whose status is still done) leave the guest status done.
func TestParseGuestStatusCloudInitNotFailures(t *testing.T) {
	const finished = "[  125.810031] cloud-init[512]: Cloud-init v. 22.4.2 finished at Thu, 03 Dec 2026 07:19:02 +0000. " +
		"Datasource DataSourceNoCloud [seed=/dev/vdb][dsmode=net].  Up 125.51 seconds\r\n"
	tests := []struct {
		name, why, line string
	}{
		{"invalid cloud-config", "22.4.2 config/schema.py:453 warns; the valid keys still apply",
			ci22 + "schema.py[WARNING]: Invalid cloud-config provided: Please run 'sudo cloud-init schema --system' to see the schema errors."},
		{"invalid cloud-config, 24.4", "24.4.1 config/schema.py:801 warns; the valid keys still apply",
			ci24 + "schema.py[WARNING]: cloud-config failed schema validation! You may run 'sudo cloud-init schema --system' to check the details."},
		{"user data of an unknown type", "22.4.2 handlers/__init__.py:241, 24.4.1 :240 warn and skip the part",
			ci22 + "__init__.py[WARNING]: Unhandled non-multipart (text/x-not-multipart) userdata: 'b'hello world''..."},
		{"empty cloud-config part", "22.4.2 handlers/cloud_config.py:146, 24.4.1 :152 warn and skip the part",
			ci22 + "cloud_config.py[WARNING]: Failed at merging in cloud config part from part-001: empty cloud config"},
		{"a script's own output", "a user script's output shares cloud-init's prefix; only its exit status counts",
			ci22Raw + "Failed running the health check, retrying: Traceback (most recent call last): failed stage"},
		{"a script's traceback", "a Python script of the user that printed a traceback and went on",
			ci22Raw + "Traceback (most recent call last):"},
		{"signal from a reboot", "24.4.1 signal_handler.py:23: a user script that reboots makes cloud-init exit 0",
			"Cloud-init 24.4.1 received SIGTERM, exiting"},
		{"hotplug daemon failed", "24.4.1 cmd/status.py:318 does not count cloud-init-hotplugd",
			"[FAILED] Failed to start cloud-init-hotplugd.service - cloud-init hotplug hook daemon."},
		{"ordinary stage unit", "a stage that finished",
			"[  OK  ] Finished cloud-config.service - Apply the settings specified in cloud-config."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := parseGuestStatus(tt.line + "\r\n" + finished)
			if got.CloudInit != agentapi.CloudInitDone || len(got.CloudInitErrors) != 0 {
				t.Errorf("cloud-init state %q (failure lines %q), want done, for the line (%s):\n%q",
					got.CloudInit, got.CloudInitErrors, tt.why, tt.line)
			}
		})
	}
}

// TestParseGuestStatusHostname: the hostname of a cloud-init guest comes
// from getty's login prompt on the serial console (the guest's hostname when
// it printed it: the last prompt wins), else from the comment of the SSH host
// keys that cloud-init prints (root@<hostname>); the busybox guest's
// kvm-guest-hostname line keeps working.
func TestParseGuestStatusHostname(t *testing.T) {
	const keys = "-----BEGIN SSH HOST KEY KEYS-----\r\n" +
		"ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBE7k= root@deb-keys\r\n" +
		"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDfm root@deb-keys\r\n" +
		"-----END SSH HOST KEY KEYS-----\r\n"
	tests := []struct {
		name, console, want string
	}{
		{"debian login prompt", "[  OK  ] Started serial-getty@ttyS0.service - Serial Getty on ttyS0.\r\r\n" +
			"[   77.709598] cloud-init[423]: Cloud-init v. 22.4.2 running 'modules:config' at Thu, 03 Dec 2026 07:18:31 +0000. Up 77.20 seconds.\r\n" +
			"\r\r\nDebian GNU/Linux 12 demo-guest ttyS0\r\n\r\ndemo-guest login: ", "demo-guest"},
		{"the last prompt wins", "debian login: \r\n\r\nDebian GNU/Linux 12 web-1 ttyS0\r\n\r\nweb-1 login: ", "web-1"},
		{"a prompt being written does not count", "Debian GNU/Linux 12 web-1 ttyS0\r\n\r\nweb-1 log", ""},
		{"last login is no prompt", "web-1 login: root\r\nPassword: \r\nLast login: Thu Dec  3 07:18:31 UTC 2026 on ttyS0\r\n", "web-1"},
		{"ssh host keys", "[  125.810031] cloud-init[512]: Cloud-init v. 22.4.2 finished at x\r\n" + keys, "deb-keys"},
		{"keys from the user data name no host", keys + "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGiv root@localhost\r\n", "deb-keys"},
		{"the prompt wins over the keys", keys + "\r\ndeb-2 login: ", "deb-2"},
		{"busybox", "kvm-guest-ready\nkvm-guest-hostname bb-1\n", "bb-1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := parseGuestStatus(tt.console); got.Hostname != tt.want {
				t.Errorf("hostname %q, want %q, from the console:\n%q", got.Hostname, tt.want, tt.console)
			}
		})
	}
}
