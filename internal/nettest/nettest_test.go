package nettest

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestTwoNamespacesTalk(t *testing.T) {
	RequireRoot(t)
	a, b := NewNS(t, "a"), NewNS(t, "b")
	if err := Veth(a, "va", b, "vb"); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{
		a.AddAddr("va", "192.0.2.1/24"),
		b.AddAddr("vb", "192.0.2.2/24"),
		b.AddRoute("198.51.100.0/24", "192.0.2.1"),
		a.Sysctl("net.ipv4.ip_forward", "1"),
		a.SetOffload("va", "tx", false),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	b.ServeHTTPName(t, "192.0.2.2:8080", "server-b")
	b.ServeUDPName(t, "192.0.2.2:5353", "udp-b")

	resp, err := a.HTTPClient(5 * time.Second).Get("http://192.0.2.2:8080/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "server-b" {
		t.Errorf("HTTP answer %q", body)
	}

	c, err := a.DialContext(context.Background(), "udp4", "192.0.2.2:5353")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	c.Write([]byte("hi"))
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if err != nil || string(buf[:n]) != "udp-b" {
		t.Errorf("UDP answer %q, %v", buf[:n], err)
	}

	for _, ns := range []*NS{a, b} {
		ce, err := ns.ChecksumErrors()
		if err != nil {
			t.Fatal(err)
		}
		if ce != (ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v", ns.Name, ce)
		}
	}
	// Sysctls are per namespace: the host's stays as it was.
	err = b.Do(func() error {
		v, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
		if err == nil && string(v) != "0\n" {
			t.Errorf("ip_forward leaked into %s: %q", b.Name, v)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestRemoveStaleKeepsLiveNamespaces(t *testing.T) {
	RequireRoot(t)
	live := NewNS(t, "live")
	// A namespace file of a pid that cannot exist stands for a crashed run.
	stale, err := createNS(Prefix + "999999999-1-crashed")
	if err != nil {
		t.Fatal(err)
	}
	stale.nl.Close()
	stale.nl = nil
	stale.handle.Close()
	if err := RemoveStale(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale.Path); !os.IsNotExist(err) {
		t.Errorf("stale namespace still there: %v", err)
		stale.Delete()
	}
	if _, err := os.Stat(filepath.Join(NetnsDir, live.Name)); err != nil {
		t.Errorf("live namespace removed: %v", err)
	}
}
