package maps

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"golang.org/x/sys/unix"
)

// oracle is an independent Go reading of what the datapath must do with a
// frame that is not service traffic: drop it when the kernel would drop it
// as malformed anyway, pass it untouched otherwise. related reports frames
// that are service traffic (to a frontend, or from a backend port: a
// possible reply), which the oracle does not judge.
func oracle(b []byte, frontends map[Frontend]bool, backends map[netip.AddrPort]bool) (v verdict, related bool) {
	if binary.BigEndian.Uint16(b[12:]) != 0x0800 {
		return pass, false
	}
	ip := b[14:]
	if len(ip) < 20 || ip[0]>>4 != 4 || ip[0]&0xf < 5 {
		return drop, false
	}
	ihl := int(ip[0]&0xf) * 4
	tot := int(binary.BigEndian.Uint16(ip[2:]))
	if ihl > len(ip) || tot < ihl || tot > len(ip) {
		return drop, false
	}
	if binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 {
		return pass, false
	}
	proto := ip[9]
	l4 := ip[ihl:]
	switch proto {
	case protoTCP:
		if len(l4) < 20 || tot < ihl+20 || l4[12]>>4 < 5 {
			return drop, false
		}
	case protoUDP:
		if len(l4) < 8 || tot < ihl+8 {
			return drop, false
		}
	default:
		return pass, false
	}
	src := netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[12:16])), binary.BigEndian.Uint16(l4[0:]))
	dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[16:20])), binary.BigEndian.Uint16(l4[2:]))
	if frontends[Frontend{Addr: dst, Proto: Protocol(proto)}] || backends[src] {
		return pass, true
	}
	return pass, false
}

func FuzzNonServiceTraffic(f *testing.F) {
	d := newDatapath(f, Options{})
	frontends := map[Frontend]bool{}
	backends := map[netip.AddrPort]bool{}
	for fr, bs := range map[Frontend][]Backend{
		fe(vipTCP, TCP):   {be(beTCP)},
		fe(vipUDP, UDP):   {be(beUDP)},
		fe(vipEmpty, TCP): nil,
	} {
		mustSet(f, d, fr, bs...)
		frontends[fr] = true
		for _, b := range bs {
			backends[b.Addr] = true
		}
	}

	for _, c := range append(untouchedRows(hookTC), malformedRows(hookXDP)...) {
		f.Add(c.in.bytes())
	}
	seeds := []frame{
		tcpFrame(client, "10.2.3.4:443", tcpSYN|tcpACK, "hello"),
		udpFrame(client, "10.96.0.10:54", "other port"),
		udpFrame("10.2.3.4:53", client, "not a reply of ours"),
		tcpFrame(client, vipTCP, tcpSYN, ""), // service traffic: skipped by the oracle
	}
	opts := tcpFrame(client, "10.96.0.12:80", tcpACK, "x")
	opts.ipOptions = []byte{7, 7, 4, 0, 0, 0, 0, 0}
	seeds = append(seeds, opts)
	for _, s := range seeds {
		f.Add(s.bytes())
	}

	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < 14 || len(in) > 1500 {
			return // test runs need an Ethernet header; keep frames MTU-sized
		}
		want, related := oracle(in, frontends, backends)
		if related {
			return
		}
		for _, h := range append(hooks, hookUplinkTC) {
			prog, okV, dropV := d.tcProg, uint32(tcOK), uint32(tcShot)
			switch h {
			case hookUplinkTC:
				// The uplinks' tc path judges a frame as XDP does,
				// on an skb.
				prog = d.uplinkLBProg
			case hookXDP:
				prog, okV, dropV = d.xdpProg, xdpPass, xdpDrop
			case hookTCEgress:
				// Egress only translates ICMP errors about known
				// flows (there are none here): it never drops.
				prog, dropV = d.tcEgressProg, tcOK
			case hookUplink:
				// Frames without topolb's metadata are none of
				// tc_uplink's business, malformed or not.
				prog = d.uplinkProg
			}
			out := make([]byte, len(in)+256)
			ret, err := prog.Run(&ebpf.RunOptions{Data: in, DataOut: out})
			if errors.Is(err, unix.EINVAL) && h != hookXDP {
				continue // the tc test run refuses some runts; XDP judges them
			}
			if err != nil {
				t.Fatalf("%s: test run: %v", h, err)
			}
			wantRet := okV
			if want == drop && h != hookUplink {
				wantRet = dropV
			}
			if ret != wantRet {
				t.Fatalf("%s: verdict %d, want %d for %x", h, ret, wantRet, in)
			}
			if (want == pass || h == hookUplink) && !bytes.Equal(out[:len(in)], in) {
				t.Fatalf("%s: non-service frame changed\n in %x\nout %x", h, in, out[:len(in)])
			}
		}
	})
}
