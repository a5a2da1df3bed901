package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// A small packet builder for datapath tests: readable rows, correct
// checksums by construction, and knobs for every malformation the tables
// exercise.

const (
	protoICMP = 1
	protoTCP  = 6
	protoUDP  = 17

	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpPSH = 0x08
	tcpACK = 0x10
)

type frame struct {
	src, dst netip.AddrPort
	proto    uint8
	tcpFlags uint8
	// tcpSeq, tcpAck: the TCP sequence and acknowledgement numbers; 0
	// stands for 1000 and 2000.
	tcpSeq, tcpAck uint32
	payload        []byte
	ipOptions      []byte // multiple of 4 bytes
	fragOff        uint16 // in 8-byte units
	moreFrags      bool
	ipID           uint16 // 0: 0x1234
	// ipID6 is an IPv6 fragment's 32-bit identification (fragment
	// header, RFC 8200 4.5); 0: ipID.
	ipID6 uint32
	// rawL4: payload is the whole IP payload, no L4 header built (a
	// later fragment; fragmentsOf).
	rawL4     bool
	noUDPSum  bool // UDP checksum 0 ("none")
	etherType uint16
	ttl       uint8   // 0: 64
	srcMAC    [6]byte // zero: macA
	dstMAC    [6]byte // zero: macB
	// Malformations, applied after checksums are computed.
	ihl      uint8 // override IHL when non-zero
	totLen   int   // override IPv4 total length when non-zero
	truncate int   // cut the frame to this many bytes when non-zero
	pad      int   // Ethernet padding after the IP packet
	badL4Sum bool
	badIPSum bool  // IPv4 header checksum off by one
	tcpDoff  uint8 // override TCP data offset when non-zero
	udpLen   int   // override the UDP length field when non-zero
	// vlans are the TPIDs (0x8100 802.1Q, 0x88a8 802.1ad) of VLAN tags
	// between the MACs and the EtherType, outer first, each with VID
	// testVID.
	vlans []uint16
	// ICMP error (proto protoICMP, icmpError set): type, code and the
	// 4-byte rest of the header; payload is the quote.
	icmpError          bool
	icmpType, icmpCode uint8
	icmpRest           uint32
}

// testVID is the VLAN ID of frame.vlans tags.
const testVID = 42

var (
	macA = [6]byte{0x02, 0, 0, 0, 0, 0x0a}
	macB = [6]byte{0x02, 0, 0, 0, 0, 0x0b}
)

func tcpFrame(src, dst string, flags uint8, payload string) frame {
	return frame{src: netip.MustParseAddrPort(src), dst: netip.MustParseAddrPort(dst),
		proto: protoTCP, tcpFlags: flags, payload: []byte(payload)}
}

// withSeq is f with TCP sequence number seq and acknowledgement number
// ack.
func (f frame) withSeq(seq, ack uint32) frame {
	f.tcpSeq, f.tcpAck = seq, ack
	return f
}

func udpFrame(src, dst string, payload string) frame {
	return frame{src: netip.MustParseAddrPort(src), dst: netip.MustParseAddrPort(dst),
		proto: protoUDP, payload: []byte(payload)}
}

// bytes renders the frame.
func (f frame) bytes() []byte {
	et := f.etherType
	if et == 0 {
		et = 0x0800
		if f.is6() {
			et = 0x86dd
		}
	}
	b := make([]byte, 0, 128)
	src, dst := macA, macB
	if f.srcMAC != ([6]byte{}) {
		src = f.srcMAC
	}
	if f.dstMAC != ([6]byte{}) {
		dst = f.dstMAC
	}
	b = append(b, dst[:]...)
	b = append(b, src[:]...)
	for _, tpid := range f.vlans {
		b = binary.BigEndian.AppendUint16(b, tpid)
		b = binary.BigEndian.AppendUint16(b, testVID)
	}
	b = binary.BigEndian.AppendUint16(b, et)
	if et != 0x0800 && (et != 0x86dd || !f.is6()) {
		b = append(b, f.payload...)
		return b
	}

	var l4 []byte
	proto := f.proto
	if f.rawL4 {
		proto = 0 // nothing built, no checksum
	}
	switch proto {
	case protoTCP:
		l4 = make([]byte, 20, 20+len(f.payload))
		binary.BigEndian.PutUint16(l4[0:], f.src.Port())
		binary.BigEndian.PutUint16(l4[2:], f.dst.Port())
		seq, ack := f.tcpSeq, f.tcpAck
		if seq == 0 {
			seq = 1000
		}
		if ack == 0 {
			ack = 2000
		}
		binary.BigEndian.PutUint32(l4[4:], seq)
		binary.BigEndian.PutUint32(l4[8:], ack)
		l4[12] = 5 << 4
		l4[13] = f.tcpFlags
		binary.BigEndian.PutUint16(l4[14:], 65535)
		l4 = append(l4, f.payload...)
	case protoUDP:
		l4 = make([]byte, 8, 8+len(f.payload))
		binary.BigEndian.PutUint16(l4[0:], f.src.Port())
		binary.BigEndian.PutUint16(l4[2:], f.dst.Port())
		binary.BigEndian.PutUint16(l4[4:], uint16(8+len(f.payload)))
		l4 = append(l4, f.payload...)
	case protoICMP:
		l4 = []byte{8, 0, 0, 0, 0, 1, 0, 1}
		if f.is6() {
			l4[0] = icmp6EchoRequest
		}
		if f.icmpError {
			l4 = []byte{f.icmpType, f.icmpCode, 0, 0}
			l4 = binary.BigEndian.AppendUint32(l4, f.icmpRest)
		}
		l4 = append(l4, f.payload...)
		if f.is6() {
			// ICMPv6's checksum covers the pseudo-header (RFC 4443 2.3).
			binary.BigEndian.PutUint16(l4[2:], csum(pseudoOf(f.src.Addr(), f.dst.Addr(), v6ICMP, len(l4)), l4))
		} else {
			binary.BigEndian.PutUint16(l4[2:], csum(0, l4))
		}
	default:
		l4 = append([]byte(nil), f.payload...)
	}
	// L4 checksums cover the whole datagram; a fragment carries a slice
	// of it, which is all the datapath needs to see.
	switch proto {
	case protoTCP:
		binary.BigEndian.PutUint16(l4[16:], csum(pseudoOf(f.src.Addr(), f.dst.Addr(), protoTCP, len(l4)), l4))
	case protoUDP:
		if !f.noUDPSum {
			s := csum(pseudoOf(f.src.Addr(), f.dst.Addr(), protoUDP, len(l4)), l4)
			if s == 0 {
				s = 0xffff
			}
			binary.BigEndian.PutUint16(l4[6:], s)
		}
	}
	if f.badL4Sum && len(l4) >= 18 {
		l4[16] ^= 0x55
	}
	if f.tcpDoff != 0 && f.proto == protoTCP {
		l4[12] = f.tcpDoff << 4
	}
	if f.udpLen != 0 && f.proto == protoUDP {
		binary.BigEndian.PutUint16(l4[4:], uint16(f.udpLen))
	}

	if f.is6() {
		next := f.proto
		if next == protoICMP {
			next = v6ICMP
		}
		if f.rawL4 {
			// A fragment (fragmentsOf): its fragment header first.
			id := f.ipID6
			if id == 0 {
				id = uint32(f.ipID)
			}
			fh := make([]byte, 8)
			fh[0] = next
			fo := f.fragOff << 3
			if f.moreFrags {
				fo |= 1
			}
			binary.BigEndian.PutUint16(fh[2:], fo)
			binary.BigEndian.PutUint32(fh[4:], id)
			b = append(b, ipv6Header(f.src.Addr(), f.dst.Addr(), f.ttlOrDefault(), v6Fragment, len(fh)+len(l4))...)
			return append(append(b, fh...), l4...)
		}
		return append(append(b, ipv6Header(f.src.Addr(), f.dst.Addr(), f.ttlOrDefault(), next, len(l4))...), l4...)
	}
	src4, dst4 := f.src.Addr().As4(), f.dst.Addr().As4()
	ip := make([]byte, 20+len(f.ipOptions))
	ip[0] = 0x40 | uint8(len(ip)/4)
	binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)+len(l4)))
	id := f.ipID
	if id == 0 {
		id = 0x1234
	}
	binary.BigEndian.PutUint16(ip[4:], id)
	fo := f.fragOff & 0x1fff
	if f.moreFrags {
		fo |= 0x2000
	}
	binary.BigEndian.PutUint16(ip[6:], fo)
	ip[8] = 64
	if f.ttl != 0 {
		ip[8] = f.ttl
	}
	ip[9] = f.proto
	copy(ip[12:], src4[:])
	copy(ip[16:], dst4[:])
	copy(ip[20:], f.ipOptions)
	if f.ihl != 0 {
		ip[0] = 0x40 | f.ihl
	}
	if f.totLen != 0 {
		binary.BigEndian.PutUint16(ip[2:], uint16(f.totLen))
	}
	binary.BigEndian.PutUint16(ip[10:], csum(0, ip))
	if f.badIPSum {
		binary.BigEndian.PutUint16(ip[10:], binary.BigEndian.Uint16(ip[10:])+1)
	}

	b = append(b, ip...)
	b = append(b, l4...)
	b = append(b, make([]byte, f.pad)...)
	if f.truncate != 0 {
		b = b[:f.truncate]
	}
	return b
}

// fragmentsOf splits the datagram f (no IP options, no IPv6 extension
// headers) as a sender with a path MTU of 20 (IPv4) or 48 (IPv6, with
// its fragment header) + size bytes would: the L4 header and payload,
// with f's checksum over all of it, in slices of size bytes (a multiple
// of 8), each a frame with f's addresses and IP id (IPv6: in a fragment
// header, the upper-layer protocol its next header, as Linux's
// ip6_fragment builds it). Only the first carries the L4 header.
func fragmentsOf(f frame, size int) []frame {
	hlen := 20
	if f.is6() {
		hlen = 40
	}
	l4 := f.bytes()[14+hlen:]
	var out []frame
	for off := 0; off < len(l4); off += size {
		end := min(off+size, len(l4))
		out = append(out, frame{src: f.src, dst: f.dst, proto: f.proto, ipID: f.ipID, ipID6: f.ipID6, rawL4: true,
			payload: l4[off:end], fragOff: uint16(off / 8), moreFrags: end < len(l4)})
	}
	return out
}

// is6 reports whether f is an IPv6 packet: its addresses are IPv6 ones
// (not IPv4-mapped). Only TCP, UDP and ICMPv6 (proto protoICMP) without
// malformations are built so; ipv6Frame builds the rest.
func (f frame) is6() bool { return f.src.Addr().Is6() && !f.src.Addr().Is4In6() }

// pseudoOf is the one's-complement sum of the pseudo-header of either
// family (RFC 768, RFC 8200 8.1).
func pseudoOf(src, dst netip.Addr, proto uint8, l4len int) uint32 {
	if src.Is4() {
		return pseudo(src.As4(), dst.As4(), proto, l4len)
	}
	var s uint32
	for _, a := range [][16]byte{src.As16(), dst.As16()} {
		for i := 0; i < 16; i += 2 {
			s += uint32(binary.BigEndian.Uint16(a[i:]))
		}
	}
	return s + uint32(l4len)>>16 + uint32(l4len)&0xffff + uint32(proto)
}

// ipv6Header is a fixed IPv6 header from src to dst with hop limit hops,
// next header next and a payload of payload bytes.
func ipv6Header(src, dst netip.Addr, hops, next uint8, payload int) []byte {
	hdr := make([]byte, 40)
	hdr[0] = 0x60
	binary.BigEndian.PutUint16(hdr[4:], uint16(payload))
	hdr[6] = next
	hdr[7] = hops
	copy(hdr[8:], src.AsSlice())
	copy(hdr[24:], dst.AsSlice())
	return hdr
}

// pseudo is the one's-complement sum of the IPv4 pseudo-header.
func pseudo(src, dst [4]byte, proto uint8, l4len int) uint32 {
	var s uint32
	s += uint32(binary.BigEndian.Uint16(src[0:])) + uint32(binary.BigEndian.Uint16(src[2:]))
	s += uint32(binary.BigEndian.Uint16(dst[0:])) + uint32(binary.BigEndian.Uint16(dst[2:]))
	s += uint32(proto) + uint32(l4len)
	return s
}

// csum returns the Internet checksum of b with an initial sum.
func csum(sum uint32, b []byte) uint16 {
	for len(b) >= 2 {
		sum += uint32(binary.BigEndian.Uint16(b))
		b = b[2:]
	}
	if len(b) == 1 {
		sum += uint32(b[0]) << 8
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// parsed is an independent reading of a frame, for expectations.
type parsed struct {
	src, dst netip.AddrPort
	proto    uint8
}

// verifyChecksums checks the IPv4 header checksum and, for complete
// unfragmented TCP/UDP packets, the L4 checksum. It knows nothing of the
// datapath.
func verifyChecksums(b []byte) (parsed, error) {
	var p parsed
	if len(b) >= 54 && binary.BigEndian.Uint16(b[12:]) == 0x86dd {
		return verifyChecksums6(b[14:])
	}
	if len(b) < 34 || binary.BigEndian.Uint16(b[12:]) != 0x0800 {
		return p, errors.New("not an IPv4 frame")
	}
	ip := b[14:]
	ihl := int(ip[0]&0xf) * 4
	totLen := int(binary.BigEndian.Uint16(ip[2:]))
	if ihl < 20 || totLen < ihl || totLen > len(ip) {
		return p, errors.New("malformed IPv4 header")
	}
	if csum(0, ip[:ihl]) != 0 {
		return p, fmt.Errorf("bad IPv4 header checksum %#04x", binary.BigEndian.Uint16(ip[10:]))
	}
	src4, dst4 := [4]byte(ip[12:16]), [4]byte(ip[16:20])
	p.proto = ip[9]
	l4 := ip[ihl:totLen]
	if binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 || (p.proto != protoTCP && p.proto != protoUDP) {
		p.src = netip.AddrPortFrom(netip.AddrFrom4(src4), 0)
		p.dst = netip.AddrPortFrom(netip.AddrFrom4(dst4), 0)
		return p, nil
	}
	if len(l4) < 8 {
		return p, errors.New("truncated L4 header")
	}
	p.src = netip.AddrPortFrom(netip.AddrFrom4(src4), binary.BigEndian.Uint16(l4[0:]))
	p.dst = netip.AddrPortFrom(netip.AddrFrom4(dst4), binary.BigEndian.Uint16(l4[2:]))
	if p.proto == protoUDP && binary.BigEndian.Uint16(l4[6:]) == 0 {
		return p, nil // no checksum
	}
	if s := csum(pseudo(src4, dst4, p.proto, len(l4)), l4); s != 0 {
		return p, fmt.Errorf("bad %d checksum (residue %#04x)", p.proto, s)
	}
	return p, nil
}

// verifyChecksums6 is verifyChecksums for the IPv6 packet ip without
// extension headers: the L4 checksum over the IPv6 pseudo header.
func verifyChecksums6(ip []byte) (parsed, error) {
	var p parsed
	payload := int(binary.BigEndian.Uint16(ip[4:]))
	if ip[0]>>4 != 6 || 40+payload > len(ip) {
		return p, errors.New("malformed IPv6 header")
	}
	src, dst := netip.AddrFrom16([16]byte(ip[8:24])), netip.AddrFrom16([16]byte(ip[24:40]))
	p.proto = ip[6]
	l4 := ip[40 : 40+payload]
	if p.proto != protoTCP && p.proto != protoUDP {
		p.src, p.dst = netip.AddrPortFrom(src, 0), netip.AddrPortFrom(dst, 0)
		return p, nil
	}
	if len(l4) < 8 {
		return p, errors.New("truncated L4 header")
	}
	p.src = netip.AddrPortFrom(src, binary.BigEndian.Uint16(l4[0:]))
	p.dst = netip.AddrPortFrom(dst, binary.BigEndian.Uint16(l4[2:]))
	if s := csum(pseudoOf(src, dst, p.proto, len(l4)), l4); s != 0 {
		return p, fmt.Errorf("bad %d checksum (residue %#04x)", p.proto, s)
	}
	return p, nil
}

// forwarded returns f as a node forwards it: TTL one less, and the
// Ethernet addresses of its next hop.
func (f frame) forwarded(src, dst [6]byte) frame {
	f.ttl = f.ttlOrDefault() - 1
	f.srcMAC, f.dstMAC = src, dst
	return f
}

// ttlOrDefault is the TTL the frame is built with.
func (f frame) ttlOrDefault() uint8 {
	if f.ttl == 0 {
		return 64
	}
	return f.ttl
}

// withAddrs returns f with source and destination replaced, as the
// datapath should have rewritten it.
func (f frame) withAddrs(src, dst string) frame {
	if src != "" {
		f.src = netip.MustParseAddrPort(src)
	}
	if dst != "" {
		f.dst = netip.MustParseAddrPort(dst)
	}
	return f
}

// ICMP error types and codes of the tables.
const (
	icmpDestUnreach  = 3
	icmpTimeExceeded = 11
	icmpPortUnreach  = 3
	icmpFragNeeded   = 4
)

// icmpErr is an ICMP error from src to dst quoting the first quoteLen
// bytes of the IP packet of about (0: its header and 8 bytes, as RFC 792
// asks; -1: all of it); an ICMPv6 error when about is an IPv6 packet.
func icmpErr(src, dst string, typ, code uint8, about frame, quoteLen int) frame {
	ip := about.bytes()[14:]
	switch {
	case quoteLen == 0:
		quoteLen = l3HeaderLen(about.bytes()) + 8
	case quoteLen < 0 || quoteLen > len(ip):
		quoteLen = len(ip)
	}
	return frame{src: netip.AddrPortFrom(netip.MustParseAddr(src), 0), dst: netip.AddrPortFrom(netip.MustParseAddr(dst), 0),
		proto: protoICMP, icmpError: true, icmpType: typ, icmpCode: code, payload: append([]byte(nil), ip[:quoteLen]...)}
}

// verifyICMP checks the checksums of an ICMP message in a frame: the outer
// IPv4 header's, the ICMP checksum over the whole message, and for an
// error the quoted IPv4 header's; for an ICMPv6 message (verifyICMP6) its
// checksum over the pseudo-header. It knows nothing of the datapath.
func verifyICMP(b []byte) error {
	if len(b) >= 54 && binary.BigEndian.Uint16(b[12:]) == 0x86dd {
		return verifyICMP6(b[14:])
	}
	if _, err := verifyChecksums(b); err != nil {
		return err
	}
	ip := b[14:]
	ihl := int(ip[0]&0xf) * 4
	msg := ip[ihl:binary.BigEndian.Uint16(ip[2:])]
	if ip[9] != protoICMP || len(msg) < 8 {
		return errors.New("not an ICMP message")
	}
	if s := csum(0, msg); s != 0 {
		return fmt.Errorf("bad ICMP checksum (residue %#04x)", s)
	}
	if msg[0] != icmpDestUnreach && msg[0] != icmpTimeExceeded {
		return nil
	}
	quote := msg[8:]
	if len(quote) < 20 {
		return errors.New("quote shorter than an IPv4 header")
	}
	if qihl := int(quote[0]&0xf) * 4; len(quote) < qihl || csum(0, quote[:qihl]) != 0 {
		return errors.New("bad quoted IPv4 header checksum")
	}
	return nil
}

// verifyICMP6 checks the ICMPv6 message in the IPv6 packet ip (no
// extension headers): its checksum over the pseudo-header (RFC 4443 2.3),
// and for an error (a type below 128) that it quotes an IPv6 packet.
func verifyICMP6(ip []byte) error {
	payload := int(binary.BigEndian.Uint16(ip[4:]))
	if ip[0]>>4 != 6 || 40+payload > len(ip) || ip[6] != v6ICMP || payload < 8 {
		return errors.New("not an ICMPv6 message")
	}
	src, dst := netip.AddrFrom16([16]byte(ip[8:24])), netip.AddrFrom16([16]byte(ip[24:40]))
	msg := ip[40 : 40+payload]
	if s := csum(pseudoOf(src, dst, v6ICMP, len(msg)), msg); s != 0 {
		return fmt.Errorf("bad ICMPv6 checksum (residue %#04x)", s)
	}
	if msg[0] < 128 && (len(msg) < 8+40 || msg[8]>>4 != 6) {
		return errors.New("ICMPv6 error quoting no IPv6 header")
	}
	return nil
}
