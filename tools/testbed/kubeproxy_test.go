package testbed

import (
	"net/netip"
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// Excerpts of kube-proxy v1.37.2's rules on a testbed node.
const (
	nftRuleset = `table ip kube-proxy {
	chain service-SUSTUHLJ-default/web/tcp/http {
		meta l4proto tcp dnat ip to numgen random mod 2 map { 0 : 10.244.1.3 . 8080, 1 : 10.244.2.2 . 8080 }
	}

	chain service-7UAOZUXB-default/node-hints/udp/echo {
		meta l4proto udp dnat to 10.244.1.3:5353
	}

	chain service-endpoints-check {
		ip daddr . meta l4proto . th dport vmap @no-endpoint-services
	}
}
`
	iptablesSave = `*nat
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL
-A KUBE-SVC-CDGGSHYLG3RE2FKL ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.1.3:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-2AZ33KU3V5PGPQZH
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.2.2:8080" -j KUBE-SEP-4EX2N4PG4ASNZOBF
-A KUBE-SVC-J2WSFT5GOQDV4646 -m comment --comment "default/web:echo -> 10.244.2.2:5353" -j KUBE-SEP-55HSQ3CPINLJE4WK
-A KUBE-SEP-2AZ33KU3V5PGPQZH -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.1.3:8080
COMMIT
`
)

func TestParseKubeProxyRules(t *testing.T) {
	got := parseNFTables([]byte(nftRuleset))
	want := map[string][]string{
		"default/web/http/TCP":        {"10.244.1.3:8080", "10.244.2.2:8080"},
		"default/node-hints/echo/UDP": {"10.244.1.3:5353"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("nftables: got %v, want %v", got, want)
	}
	ports := []Decision{
		{Service: "default/web", Port: "http", Protocol: v1.ProtocolTCP, Frontend: netip.MustParseAddrPort("10.96.0.10:80")},
		{Service: "default/web", Port: "echo", Protocol: v1.ProtocolUDP, Frontend: netip.MustParseAddrPort("10.96.0.10:53")},
	}
	got = parseIPTables([]byte(iptablesSave), ports)
	want = map[string][]string{
		"default/web/http/TCP": {"10.244.1.3:8080", "10.244.2.2:8080"},
		"default/web/echo/UDP": {"10.244.2.2:5353"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("iptables: got %v, want %v", got, want)
	}
}
