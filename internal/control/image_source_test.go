package control_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// answerRaw serves every connection on 127.0.0.1 the same raw HTTP answer
// and returns the listener's address.
func answerRaw(t *testing.T, answer string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = conn.Close() }()
				r := bufio.NewReader(conn)
				for { // the request's head
					line, err := r.ReadString('\n')
					if err != nil || line == "\r\n" {
						break
					}
				}
				_, _ = conn.Write([]byte(answer))
			}()
		}
	}()
	return ln.Addr().String()
}

// What an image source answers never reaches the image's status, which
// every token that reads images sees, nor the VM create's error: an error
// page, a reason phrase and a malformed status line carrying a marker come
// out as "GET <url without credentials or query>: 404 Not Found" or as a
// fixed sentence.
func TestImageSourceAnswerNeverEchoed(t *testing.T) {
	const marker = "kvm-remote-marker-51c2"
	body := "<html>internal page " + marker + "</html>"
	notFound := answerRaw(t, fmt.Sprintf("HTTP/1.1 404 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", marker, len(body), body))
	garbled := answerRaw(t, "HTTP/1.1 99x "+marker+"\r\n\r\n")
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := startSimAgent(t)
	c.RegisterHost(t, "host-a", a.Address)
	ctx := context.Background()
	for i, tc := range []struct{ url, want string }{
		{"http://user:pass@" + notFound + "/image.qcow2?sig=secret", "GET http://" + notFound + "/image.qcow2: 404 Not Found"},
		{"http://" + garbled + "/image.qcow2", "GET http://" + garbled + "/image.qcow2: the answer was not usable HTTP"},
	} {
		name := fmt.Sprintf("echo-%d", i)
		sha := strings.Repeat(fmt.Sprintf("%x", i+1), 64)
		if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: name, SourceURL: tc.url, SHA256: sha, Format: "qcow2"}); err != nil {
			t.Fatal(err)
		}
		_, err := c.Client.CreateVM(ctx, imageVM(name+"-vm", name, ""), "")
		if err == nil || strings.Contains(err.Error(), marker) || strings.Contains(err.Error(), "secret") {
			t.Errorf("%s: create: %v; want an error without the source's answer", name, err)
		}
		img := waitImageHost(t, c, name, "host-a", api.ImageFailed)
		reason := img.Hosts[0].Reason
		if strings.Contains(reason, marker) || strings.Contains(reason, "secret") || strings.Contains(reason, "pass") || !strings.Contains(reason, tc.want) {
			t.Errorf("%s: host status reason %q; want %q and nothing of the answer", name, reason, tc.want)
		}
	}
}
