package testbed

import (
	"encoding/binary"
	"net/netip"

	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
)

// Fields of the IPv4 UDP frames the floods send (udpFrame: no IP
// options), as the testbed's own BPF programs (the wire sink, the
// redirect floor) read them: offsets from the Ethernet header.
const (
	ethLen, ipLen, udpLen = 14, 20, 8
	offEtherType          = 12
	offVersionIHL         = ethLen
	offProto              = ethLen + 9
	offIPCsum             = ethLen + 10
	offDaddr              = ethLen + 16
	offDport              = ethLen + ipLen + 2
	offUDPCsum            = ethLen + ipLen + 6
	ipv4NoOptions         = 0x45
	etherTypeIPv4         = 0x0800
)

// be16 is what loading a big-endian 16-bit field holding v gives.
func be16(v uint16) int32 {
	return int32(binary.NativeEndian.Uint16(binary.BigEndian.AppendUint16(nil, v)))
}

// be32 is what loading an IPv4 address field holding a gives.
func be32(a netip.Addr) int32 {
	b := a.As4()
	return int32(binary.NativeEndian.Uint32(b[:]))
}

// ipv4UDP checks that the frame from R2 (data) to R3 (data_end) holds an
// Ethernet, an IPv4 header without options and a UDP header, jumping to
// miss where it does not. It keeps R2 and R3 and uses R4.
func ipv4UDP(miss string) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, ethLen+ipLen+udpLen),
		asm.JGT.Reg(asm.R4, asm.R3, miss),
		asm.LoadMem(asm.R4, asm.R2, offEtherType, asm.Half),
		asm.JNE.Imm32(asm.R4, be16(etherTypeIPv4), miss),
		asm.LoadMem(asm.R4, asm.R2, offVersionIHL, asm.Byte),
		asm.JNE.Imm32(asm.R4, ipv4NoOptions, miss),
		asm.LoadMem(asm.R4, asm.R2, offProto, asm.Byte),
		asm.JNE.Imm32(asm.R4, unix.IPPROTO_UDP, miss),
	}
}
