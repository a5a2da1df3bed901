package netns

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// link looks ifname up inside the namespace.
func (ns *NS) link(ifname string) (netlink.Link, error) {
	l, err := ns.nl.LinkByName(ifname)
	if err != nil {
		return nil, fmt.Errorf("%s: link %s: %w", ns.Name, ifname, err)
	}
	return l, nil
}

// LinkUp sets ifname up.
func (ns *NS) LinkUp(ifname string) error {
	l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	if err := ns.nl.LinkSetUp(l); err != nil {
		return fmt.Errorf("%s: set %s up: %w", ns.Name, ifname, err)
	}
	return nil
}

// Veth creates a veth pair, aName in a and bName in b, and sets both up.
func Veth(a *NS, aName string, b *NS, bName string) error {
	v := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: aName},
		PeerName:      bName,
		PeerNamespace: netlink.NsFd(b.handle),
	}
	if err := a.nl.LinkAdd(v); err != nil {
		return fmt.Errorf("add veth %s:%s / %s:%s: %w", a.Name, aName, b.Name, bName, err)
	}
	if err := a.LinkUp(aName); err != nil {
		return err
	}
	return b.LinkUp(bName)
}

// bridgeNetfilter are the br_netfilter settings that send bridged frames
// through the namespace's iptables, arptables and ip6tables (and its
// IPv4 header checks, which drop a bad checksum). They exist only where
// br_netfilter is loaded, as on Docker hosts and Kubernetes nodes, and are
// on by default in every namespace there.
var bridgeNetfilter = []string{
	"net.bridge.bridge-nf-call-iptables",
	"net.bridge.bridge-nf-call-ip6tables",
	"net.bridge.bridge-nf-call-arptables",
}

// AddBridge creates a bridge and sets it up. The bridge only switches:
// bridged frames skip netfilter (bridgeNetfilter off in the namespace)
// whether or not the host loaded br_netfilter.
func (ns *NS) AddBridge(name string) error {
	for _, key := range bridgeNetfilter {
		err := ns.Sysctl(key, "0")
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	if err := ns.nl.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}); err != nil {
		return fmt.Errorf("%s: add bridge %s: %w", ns.Name, name, err)
	}
	return ns.LinkUp(name)
}

// SetMaster plugs ifname into the bridge master.
func (ns *NS) SetMaster(ifname, master string) error {
	l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	m, err := ns.link(master)
	if err != nil {
		return err
	}
	if err := ns.nl.LinkSetMaster(l, m); err != nil {
		return fmt.Errorf("%s: attach %s to %s: %w", ns.Name, ifname, master, err)
	}
	return nil
}

// SetAlias sets ifname's alias (`ip link set IFNAME alias ALIAS`).
func (ns *NS) SetAlias(ifname, alias string) error {
	l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	if err := ns.nl.LinkSetAlias(l, alias); err != nil {
		return fmt.Errorf("%s: alias %s: %w", ns.Name, ifname, err)
	}
	return nil
}

// SetMTU sets ifname's MTU.
func (ns *NS) SetMTU(ifname string, mtu int) error {
	l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	if err := ns.nl.LinkSetMTU(l, mtu); err != nil {
		return fmt.Errorf("%s: set MTU of %s to %d: %w", ns.Name, ifname, mtu, err)
	}
	return nil
}

// MTU returns ifname's MTU.
func (ns *NS) MTU(ifname string) (int, error) {
	l, err := ns.link(ifname)
	if err != nil {
		return 0, err
	}
	return l.Attrs().MTU, nil
}

// HardwareAddr returns ifname's MAC address.
func (ns *NS) HardwareAddr(ifname string) (net.HardwareAddr, error) {
	l, err := ns.link(ifname)
	if err != nil {
		return nil, err
	}
	return l.Attrs().HardwareAddr, nil
}

// AddAddr assigns prefix (for example "10.1.0.2/24") to ifname.
func (ns *NS) AddAddr(ifname, prefix string) error {
	l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	addr, err := netlink.ParseAddr(prefix)
	if err != nil {
		return fmt.Errorf("%s: address %q: %w", ns.Name, prefix, err)
	}
	if addr.IP.To4() == nil {
		// Usable at once: duplicate address detection would hold an
		// IPv6 address tentative for a second or more.
		addr.Flags |= unix.IFA_F_NODAD
	}
	if err := ns.nl.AddrAdd(l, addr); err != nil {
		return fmt.Errorf("%s: add address %s to %s: %w", ns.Name, prefix, ifname, err)
	}
	return nil
}

// AddRoute routes dst (a prefix, or "default") via the gateway gw; the
// kernel picks the device that reaches gw.
func (ns *NS) AddRoute(dst, gw string) error { return ns.AddRouteDev(dst, "", gw) }

// AddRouteDev adds a route to dst (a prefix, or "default"): through dev
// when dev is not empty, via gw when gw is not empty, else on-link (scope
// link) through dev.
func (ns *NS) AddRouteDev(dst, dev, gw string) error {
	r := &netlink.Route{}
	if dst != "default" {
		p, err := netip.ParsePrefix(dst)
		if err != nil {
			return fmt.Errorf("%s: route destination %q: %w", ns.Name, dst, err)
		}
		p = p.Masked()
		r.Dst = &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
	}
	if dev != "" {
		l, err := ns.link(dev)
		if err != nil {
			return err
		}
		r.LinkIndex = l.Attrs().Index
	}
	switch {
	case gw != "":
		a, err := netip.ParseAddr(gw)
		if err != nil {
			return fmt.Errorf("%s: gateway %q: %w", ns.Name, gw, err)
		}
		r.Gw = a.AsSlice()
	case dev == "":
		return fmt.Errorf("%s: route %s: neither a device nor a gateway", ns.Name, dst)
	default:
		r.Scope = netlink.SCOPE_LINK
	}
	if err := ns.nl.RouteAdd(r); err != nil {
		return fmt.Errorf("%s: route %s dev %q via %q: %w", ns.Name, dst, dev, gw, err)
	}
	return nil
}

// sysctlPath turns "net.ipv4.ip_forward" (or "net/ipv4/ip_forward") into
// its file under /proc/sys.
func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
}

// Sysctl writes /proc/sys/KEY (dots or slashes) inside the namespace, for
// per-namespace keys such as net.ipv4.ip_forward. A key that is not per
// namespace changes the host's value: only use per-namespace keys.
func (ns *NS) Sysctl(key, value string) error {
	return ns.Do(func() error {
		if err := os.WriteFile(sysctlPath(key), []byte(value), 0o644); err != nil {
			return fmt.Errorf("%s: sysctl %s=%s: %w", ns.Name, key, value, err)
		}
		return nil
	})
}

// ReadSysctl reads /proc/sys/KEY inside the namespace, without the
// trailing newline.
func (ns *NS) ReadSysctl(key string) (string, error) {
	var v []byte
	err := ns.Do(func() (err error) {
		v, err = os.ReadFile(sysctlPath(key))
		return err
	})
	if err != nil {
		return "", fmt.Errorf("%s: read sysctl %s: %w", ns.Name, key, err)
	}
	return strings.TrimSpace(string(v)), nil
}
