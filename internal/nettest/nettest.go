// Package nettest builds small network topologies out of named network
// namespaces and veth pairs for privileged tests and the testbed, and
// offers what such tests measure: echo servers that answer with their own
// name, offload switches and checksum error counters.
//
// Every namespace is named Prefix + "<pid>-" + a caller-chosen suffix and
// removed in t.Cleanup; RemoveStale removes those of crashed runs (whose
// pid is gone) without touching namespaces of concurrent test processes.
package nettest

import (
	"bufio"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Prefix starts the name of every namespace this package creates.
const Prefix = "tlbt-"

// NetnsDir is where named namespaces are bind-mounted (as by `ip netns`).
const NetnsDir = "/run/netns"

// RequireRoot skips t unless the process can create namespaces.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF)")
	}
}

// NS is a named network namespace.
type NS struct {
	Name string
	// Path is the bind mount, usable with nsenter --net=Path.
	Path   string
	handle netns.NsHandle
	nl     *netlink.Handle
}

var seq atomic.Uint32

// NewNS creates the namespace Prefix+"<pid>-<n>-"+suffix with loopback up,
// and deletes it in t.Cleanup (also when the test fails).
func NewNS(t testing.TB, suffix string) *NS {
	t.Helper()
	RequireRoot(t)
	name := fmt.Sprintf("%s%d-%d-%s", Prefix, os.Getpid(), seq.Add(1), suffix)
	ns, err := createNS(name)
	if err != nil {
		t.Fatalf("create netns %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := ns.Delete(); err != nil {
			t.Errorf("delete netns %s: %v", name, err)
		}
	})
	lo, err := ns.nl.LinkByName("lo")
	if err == nil {
		err = ns.nl.LinkSetUp(lo)
	}
	if err != nil {
		t.Fatalf("netns %s: loopback up: %v", name, err)
	}
	return ns
}

func createNS(name string) (*NS, error) {
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
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		return nil, err
	}
	nl, err := netlink.NewHandleAt(ns.handle)
	if err != nil {
		ns.Delete()
		return nil, fmt.Errorf("netlink handle: %w", err)
	}
	ns.nl = nl
	return ns, nil
}

// Delete removes the namespace's name and releases this package's
// references; the kernel destroys it (and its veths) once sockets created
// in it are closed.
func (ns *NS) Delete() error {
	if ns.nl != nil {
		ns.nl.Close()
		ns.nl = nil
	}
	if ns.handle.IsOpen() {
		ns.handle.Close()
	}
	err := netns.DeleteNamed(ns.Name)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.EINVAL) {
		// Not mounted: remove a leftover file, if any.
		if rmErr := os.Remove(ns.Path); rmErr == nil || errors.Is(rmErr, os.ErrNotExist) {
			return nil
		}
	}
	return err
}

// RemoveStale deletes namespaces named Prefix+"<pid>-..." whose process
// no longer exists: leftovers of crashed or killed test runs.
func RemoveStale() error {
	entries, err := os.ReadDir(NetnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), Prefix)
		if !ok {
			continue
		}
		pidStr, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidStr)
		if err != nil || pid == os.Getpid() || processAlive(pid) {
			continue
		}
		ns := &NS{Name: e.Name(), Path: filepath.Join(NetnsDir, e.Name()), handle: netns.None()}
		if err := ns.Delete(); err != nil {
			errs = append(errs, fmt.Errorf("remove stale netns %s: %w", e.Name(), err))
		}
	}
	return errors.Join(errs...)
}

func processAlive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

// Do runs fn on an OS thread locked inside the namespace. Sockets fn
// creates belong to the namespace and may be used from any goroutine
// afterwards.
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
		// A thread that cannot go back stays locked and exits with this
		// goroutine.
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// Netlink returns a netlink handle operating inside the namespace.
func (ns *NS) Netlink() *netlink.Handle { return ns.nl }

// Veth creates a veth pair: aName in a, bName in b, both up.
func Veth(a *NS, aName string, b *NS, bName string) error {
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: aName},
		PeerName:      bName,
		PeerNamespace: netlink.NsFd(b.handle),
	}
	if err := a.nl.LinkAdd(veth); err != nil {
		return fmt.Errorf("add veth %s/%s: %w", aName, bName, err)
	}
	if err := a.LinkUp(aName); err != nil {
		return err
	}
	return b.LinkUp(bName)
}

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

// AddAddr assigns prefix (for example "10.1.0.2/24") to ifname.
func (ns *NS) AddAddr(ifname, prefix string) error {
	l, err := ns.nl.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("%s: link %s: %w", ns.Name, ifname, err)
	}
	addr, err := netlink.ParseAddr(prefix)
	if err != nil {
		return err
	}
	if err := ns.nl.AddrAdd(l, addr); err != nil {
		return fmt.Errorf("%s: add %s to %s: %w", ns.Name, prefix, ifname, err)
	}
	return nil
}

// AddRoute routes dst (a prefix, or "default") via gw.
func (ns *NS) AddRoute(dst, gw string) error {
	r := &netlink.Route{Gw: netip.MustParseAddr(gw).AsSlice()}
	if dst != "default" {
		_, n, err := netParseCIDR(dst)
		if err != nil {
			return err
		}
		r.Dst = n
	}
	if err := ns.nl.RouteAdd(r); err != nil {
		return fmt.Errorf("%s: route %s via %s: %w", ns.Name, dst, gw, err)
	}
	return nil
}

// Sysctl writes value to /proc/sys/<key> (dots or slashes) inside the
// namespace, for per-netns keys such as net.ipv4.ip_forward.
func (ns *NS) Sysctl(key, value string) error {
	path := filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
	return ns.Do(func() error {
		return os.WriteFile(path, []byte(value), 0o644)
	})
}

// SetOffload switches an ethtool feature (for example "tx" for transmit
// checksum offload, or "gro") on ifname.
func (ns *NS) SetOffload(ifname, feature string, on bool) error {
	state := "off"
	if on {
		state = "on"
	}
	out, err := exec.Command("nsenter", "--net="+ns.Path, "ethtool", "-K", ifname, feature, state).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: ethtool -K %s %s %s: %w: %s", ns.Name, ifname, feature, state, err, out)
	}
	return nil
}

// ChecksumErrors are the namespace's receive checksum error counters, as
// `nstat` shows them (Udp InCsumErrors, Tcp InCsumErrors).
type ChecksumErrors struct {
	UDP uint64
	TCP uint64
}

// ChecksumErrors reads /proc/net/snmp as seen from inside the namespace.
func (ns *NS) ChecksumErrors() (ChecksumErrors, error) {
	var c ChecksumErrors
	err := ns.Do(func() error {
		f, err := os.Open("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		defer f.Close()
		snmp, err := parseSNMP(f)
		if err != nil {
			return err
		}
		c.UDP = snmp["Udp"]["InCsumErrors"]
		c.TCP = snmp["Tcp"]["InCsumErrors"]
		return nil
	})
	return c, err
}

// parseSNMP reads the header/value line pairs of /proc/net/snmp.
func parseSNMP(f *os.File) (map[string]map[string]uint64, error) {
	out := make(map[string]map[string]uint64)
	sc := bufio.NewScanner(f)
	var header []string
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if header == nil || header[0] != fields[0] {
			header = fields
			continue
		}
		proto := strings.TrimSuffix(fields[0], ":")
		m := make(map[string]uint64)
		for i := 1; i < len(fields) && i < len(header); i++ {
			v, err := strconv.ParseInt(fields[i], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("snmp %s %s: %w", proto, header[i], err)
			}
			m[header[i]] = uint64(v)
		}
		out[proto] = m
		header = nil
	}
	return out, sc.Err()
}
