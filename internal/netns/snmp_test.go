package netns

import (
	"strings"
	"testing"
)

func TestParseSNMP(t *testing.T) {
	for _, c := range []struct {
		name  string
		in    string
		proto string
		field string
		want  uint64
		// err: ParseSNMP fails; missing: Counter fails.
		err, missing bool
	}{
		{name: "udp noports", in: "Udp: InDatagrams NoPorts InErrors\nUdp: 10 7 0\n", proto: "Udp", field: "NoPorts", want: 7},
		{name: "several protocols", in: "Ip: Forwarding\nIp: 1\nTcp: MaxConn InCsumErrors\nTcp: -1 3\n", proto: "Tcp", field: "InCsumErrors", want: 3},
		{name: "counter absent", in: "Udp: NoPorts\nUdp: 1\n", proto: "Udp", field: "InCsumErrors", missing: true},
		{name: "protocol absent", in: "Tcp: InCsumErrors\nTcp: 1\n", proto: "Udp", field: "NoPorts", missing: true},
		{name: "empty", in: "", proto: "Udp", field: "NoPorts", missing: true},
		{name: "value not a number", in: "Udp: NoPorts\nUdp: x\n", err: true},
		{name: "fewer values than names", in: "Udp: NoPorts InErrors\nUdp: 1\n", err: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := ParseSNMP(strings.NewReader(c.in))
			if c.err {
				if err == nil {
					t.Fatalf("parsed %v, want an error", s)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			v, err := s.Counter(c.proto, c.field)
			switch {
			case c.missing && err == nil:
				t.Errorf("Counter(%s, %s) = %d, want an error", c.proto, c.field, v)
			case !c.missing && (err != nil || v != c.want):
				t.Errorf("Counter(%s, %s) = %d, %v; want %d", c.proto, c.field, v, err, c.want)
			}
		})
	}
}

func TestParseSNMP6(t *testing.T) {
	s, err := ParseSNMP6(strings.NewReader("Ip6InReceives                   \t12\nUdp6NoPorts \t7\nUdp6InCsumErrors\t0\nUdpLite6NoPorts 1\n\n"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		proto, field string
		want         uint64
	}{{"Ip6", "InReceives", 12}, {"Udp6", "NoPorts", 7}, {"Udp6", "InCsumErrors", 0}, {"UdpLite6", "NoPorts", 1}} {
		if v, err := s.Counter(c.proto, c.field); err != nil || v != c.want {
			t.Errorf("Counter(%s, %s) = %d, %v; want %d", c.proto, c.field, v, err, c.want)
		}
	}
	if v, err := s.Counter("Udp", "NoPorts"); err == nil {
		t.Errorf("IPv4's Udp NoPorts read from snmp6: %d", v)
	}
	for _, bad := range []string{"Udp6NoPorts x\n", "Udp6NoPorts 1 2\n", "NoPorts 1\n", "Udp6 1\n", "6NoPorts 1\n"} {
		if s, err := ParseSNMP6(strings.NewReader(bad)); err == nil {
			t.Errorf("ParseSNMP6(%q) = %v, want an error", bad, s)
		}
	}
}

func TestGrowth(t *testing.T) {
	if g, err := Growth(5, 12); err != nil || g != 7 {
		t.Errorf("Growth(5, 12) = %d, %v", g, err)
	}
	if g, err := Growth(0, 0); err != nil || g != 0 {
		t.Errorf("Growth(0, 0) = %d, %v", g, err)
	}
	if g, err := Growth(12, 5); err == nil {
		t.Errorf("Growth(12, 5) = %d, want an error", g)
	}
}

func TestOwnerPID(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"123-4-demo", 123, true},
		{"123", 0, false},
		{"x-1", 0, false},
		{"0-1", 0, false},
		{"-5-1", 0, false},
	} {
		if got, ok := OwnerPID(c.in); got != c.want || ok != c.ok {
			t.Errorf("OwnerPID(%q) = %d, %v; want %d, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}
