package nettest

import (
	"context"
	"io"
	"os"
	"testing"
	"time"
)

// TestTwoNamespacesTalk checks the test conveniences on top of
// internal/netns: the echo servers, the HTTP client, SetOffload, and the
// cleanup of NewNS.
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
		a.SetOffload("va", "tx", false),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if on, err := a.TxChecksum("va"); err != nil || on {
		t.Errorf("va: tx checksum offload %v (%v) after SetOffload off", on, err)
	}
	if err := a.SetOffload("va", "gro", false); err == nil {
		t.Error("SetOffload of an unsupported feature succeeded")
	}
	b.ServeHTTPName(t, "192.0.2.2:8080", "server-b")
	b.ServeUDPName(t, "192.0.2.2:5353", "udp-b")

	resp, err := a.HTTPClient(5 * time.Second).Get("http://192.0.2.2:8080/")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "server-b" {
		t.Errorf("HTTP answer %q, %v", body, err)
	}

	c, err := a.DialContext(context.Background(), "udp4", "192.0.2.2:5353")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
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
}

// TestNewNSIsRemoved checks that a namespace of NewNS is gone once its
// test has ended.
func TestNewNSIsRemoved(t *testing.T) {
	RequireRoot(t)
	var path string
	t.Run("inner", func(t *testing.T) {
		path = NewNS(t, "gone").Path
		if _, err := os.Stat(path); err != nil {
			t.Fatalf("namespace missing while its test runs: %v", err)
		}
	})
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("namespace %s still there after its test: %v", path, err)
	}
}
