package testbed

import (
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
)

// napiForXDP attaches an XDP program that passes every frame to ifname in
// ns (a switch port, the peer of a node's uplink). A veth accepts frames
// its peer's XDP program transmits (XDP_TX, XDP_REDIRECT) only when it
// has a NAPI instance, which an XDP program or GRO gives it; a real NIC's
// driver always can. GRO would do as well, but it validates checksums on
// the way and marks good packets CHECKSUM_UNNECESSARY, and a receiver then
// no longer verifies a checksum that the next node's XDP program rewrote:
// the testbed's zero-checksum-errors checks would prove nothing for those
// paths. The attachment is netlink's (not a bpf_link), so it lives as long
// as the interface.
func napiForXDP(ns *NS, ifname string) error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "testbed_pass", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R0, xdpPass),
			asm.Return(),
		},
	})
	if err != nil {
		return fmt.Errorf("load the switch ports' XDP pass program: %w", err)
	}
	defer prog.Close()
	l, err := ns.Netlink().LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", ns.Name, ifname, err)
	}
	// The package-level call talks to the calling thread's namespace.
	err = ns.Do(func() error { return netlink.LinkSetXdpFdWithFlags(l, prog.FD(), nl.XDP_FLAGS_DRV_MODE) })
	if err != nil {
		return fmt.Errorf("%s: attach XDP pass to %s (for its peer's XDP_TX): %w", ns.Name, ifname, err)
	}
	return nil
}
