package agent

import (
	"strings"
	"testing"
)

// BenchmarkParseGuestStatusMiB reads a guest status from 1 MiB of console
// (what Guest reads, every second while a wait_for runs): a Debian boot's
// kinds of lines, repeated.
func BenchmarkParseGuestStatusMiB(b *testing.B) {
	boot := "[   21.246279] systemd[1]: Starting cloud-init-local.service - Initial cloud-init job (pre-networking)...\r\n" +
		"[\x1b[0;32m  OK  \x1b[0m] Finished \x1b[0;1;39mcloud-init.servic…it job (metadata service crawler).\r\r\n" +
		"[   55.287503] cloud-init[376]: Cloud-init v. 22.4.2 running 'init' at Thu, 03 Dec 2026 07:18:09 +0000. Up 54.59 seconds.\r\n" +
		"[   55.635896] cloud-init[376]: ci-info: |  eth0  | True |         10.0.2.15          | 255.255.255.0 | global | 02:33:dd:ca:a9:be |\r\n" +
		"[   69.022672] cloud-init[376]: Generating public/private rsa key pair.\r\n" +
		"[   69.031093] cloud-init[376]: SHA256:lzLo2VsF6aVRuzR8Dquofym7o6q03bo74chLH4oH7uA root@demo-guest\r\n" +
		"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDfm root@demo-guest\r\n" +
		"\r\r\nDebian GNU/Linux 12 demo-guest ttyS0\r\n\r\ndemo-guest login: \r\n"
	console := strings.Repeat(boot, (1<<20)/len(boot))
	b.SetBytes(int64(len(console)))
	for b.Loop() {
		parseGuestStatus(console)
	}
}
