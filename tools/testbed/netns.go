package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NetnsDir is where named namespaces are bind-mounted, as `ip netns` does.
const NetnsDir = "/run/netns"

// NS is a named network namespace created by the testbed.
type NS struct {
	// Name is the file name under NetnsDir.
	Name string
	// Path is the bind mount: use it with `nsenter --net=PATH`.
	Path   string
	handle netns.NsHandle
	nl     *netlink.Handle
}

// newNS creates a named namespace with loopback up.
func newNS(name string) (_ *NS, err error) {
	ns := &NS{Name: name, Path: filepath.Join(NetnsDir, name), handle: netns.None()}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		// NewNamed moves this thread into the new namespace.
		h, err := netns.NewNamed(name)
		if err == nil {
			ns.handle = h
		}
		// A thread that cannot go back stays locked and exits with this
		// goroutine instead of serving others from the wrong namespace.
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			ns.Delete()
		}
	}()
	if ns.nl, err = netlink.NewHandleAt(ns.handle); err != nil {
		return nil, fmt.Errorf("netns %s: netlink handle: %w", name, err)
	}
	if err := ns.LinkUp("lo"); err != nil {
		return nil, err
	}
	return ns, nil
}

// Delete removes the namespace's name and releases the testbed's
// references; the kernel destroys the namespace, with its interfaces, once
// no process or socket holds it.
func (ns *NS) Delete() error {
	if ns.nl != nil {
		ns.nl.Close()
		ns.nl = nil
	}
	if ns.handle.IsOpen() {
		ns.handle.Close()
		ns.handle = netns.None()
	}
	return deleteNamedNS(ns.Path)
}

// deleteNamedNS unmounts and removes a named namespace's file; a missing
// one is not an error.
func deleteNamedNS(path string) error {
	err := unix.Unmount(path, unix.MNT_DETACH)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount netns %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove netns %s: %w", path, err)
	}
	return nil
}

// Do runs fn on an OS thread locked inside the namespace. Sockets fn
// creates belong to the namespace for good and may be used from any
// goroutine afterwards.
func (ns *NS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(ns.handle); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns %s: %w", ns.Name, err)
			return
		}
		err = fn()
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// Netlink returns a netlink handle that operates inside the namespace.
func (ns *NS) Netlink() *netlink.Handle { return ns.nl }

// LinkUp sets ifname up.
func (ns *NS) LinkUp(ifname string) error {
	l, err := ns.nl.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", ns.Name, ifname, err)
	}
	if err := ns.nl.LinkSetUp(l); err != nil {
		return fmt.Errorf("%s: set %s up: %w", ns.Name, ifname, err)
	}
	return nil
}

// veth creates a veth pair, aName in a and bName in b, and sets both up.
func veth(a *NS, aName string, b *NS, bName string) error {
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

// addAddr assigns prefix to ifname.
func (ns *NS) addAddr(ifname string, prefix string) error {
	l, err := ns.nl.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", ns.Name, ifname, err)
	}
	addr, err := netlink.ParseAddr(prefix)
	if err != nil {
		return err
	}
	if err := ns.nl.AddrAdd(l, addr); err != nil {
		return fmt.Errorf("%s: add address %s to %s: %w", ns.Name, prefix, ifname, err)
	}
	return nil
}

// addRoute adds a route to dst ("default" or a prefix) through ifname,
// via gw when gw is not empty (else on-link).
func (ns *NS) addRoute(dst, ifname, gw string) error {
	l, err := ns.nl.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", ns.Name, ifname, err)
	}
	r := &netlink.Route{LinkIndex: l.Attrs().Index}
	if dst != "default" {
		_, n, err := net.ParseCIDR(dst)
		if err != nil {
			return err
		}
		r.Dst = n
	}
	if gw != "" {
		r.Gw = net.ParseIP(gw)
	} else {
		r.Scope = netlink.SCOPE_LINK
	}
	if err := ns.nl.RouteAdd(r); err != nil {
		return fmt.Errorf("%s: route %s dev %s via %q: %w", ns.Name, dst, ifname, gw, err)
	}
	return nil
}

// Sysctl writes /proc/sys/KEY (dots or slashes) inside the namespace, for
// per-namespace keys such as net.ipv4.ip_forward.
func (ns *NS) Sysctl(key, value string) error {
	path := filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
	return ns.Do(func() error {
		if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
			return fmt.Errorf("%s: sysctl %s=%s: %w", ns.Name, key, value, err)
		}
		return nil
	})
}

// ethtool commands (include/uapi/linux/ethtool.h).
const (
	ethtoolGTXCSUM = 0x16
	ethtoolSTXCSUM = 0x17
)

type ethtoolValue struct {
	cmd  uint32
	data uint32
}

// ifreqData is struct ifreq with ifr_data.
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [24 - unsafe.Sizeof(uintptr(0))]byte
}

// ethtool issues one SIOCETHTOOL value command on ifname in the namespace.
func (ns *NS) ethtool(ifname string, cmd, data uint32) (uint32, error) {
	v := ethtoolValue{cmd: cmd, data: data}
	err := ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		var ifr ifreqData
		copy(ifr.name[:unix.IFNAMSIZ-1], ifname)
		ifr.data = unsafe.Pointer(&v)
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
		runtime.KeepAlive(&v)
		if errno != 0 {
			return errno
		}
		return nil
	})
	return v.data, err
}

// SetTxChecksum switches transmit checksum offload of ifname, as
// `ethtool -K IFNAME tx on|off` does. Off, the kernel computes checksums in
// software before the packet leaves, like a real NIC puts them on the wire,
// so the receiver verifies what the datapath wrote.
func (ns *NS) SetTxChecksum(ifname string, on bool) error {
	var data uint32
	if on {
		data = 1
	}
	if _, err := ns.ethtool(ifname, ethtoolSTXCSUM, data); err != nil {
		return fmt.Errorf("%s: set tx checksum offload of %s to %v: %w", ns.Name, ifname, on, err)
	}
	return nil
}

// TxChecksum reports whether transmit checksum offload is on for ifname.
func (ns *NS) TxChecksum(ifname string) (bool, error) {
	v, err := ns.ethtool(ifname, ethtoolGTXCSUM, 0)
	if err != nil {
		return false, fmt.Errorf("%s: get tx checksum offload of %s: %w", ns.Name, ifname, err)
	}
	return v != 0, nil
}

// Listen opens a listener inside the namespace.
func (ns *NS) Listen(network, addr string) (net.Listener, error) {
	var l net.Listener
	err := ns.Do(func() (err error) {
		l, err = net.Listen(network, addr)
		return err
	})
	return l, err
}

// ListenPacket opens a packet socket inside the namespace.
func (ns *NS) ListenPacket(network, addr string) (net.PacketConn, error) {
	var c net.PacketConn
	err := ns.Do(func() (err error) {
		c, err = net.ListenPacket(network, addr)
		return err
	})
	return c, err
}

// DialContext connects from inside the namespace.
func (ns *NS) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

func newBridge(name string) *netlink.Bridge {
	return &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
}
