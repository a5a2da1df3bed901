// Package netns is topolb's one place for network namespaces: creating,
// entering and deleting named namespaces, running code inside one on a
// locked OS thread, veths, bridges, addresses, routes, MTUs, sysctls,
// transmit checksum offload (the ETHTOOL_STXCSUM ioctl) and the SNMP
// counters of /proc/net/snmp.
//
// It is a leaf: internal/nettest (privileged unit tests), tools/testbed
// (the demo and end-to-end testbed) and maps (attaching programs to
// interfaces of another namespace) build on it, and it imports none of
// them.
//
// Named namespaces are bind mounts under Dir, as `ip netns add` makes
// them, so `nsenter --net=PATH` reaches them. Their names start with a
// caller's prefix followed by "<pid>-", which lets RemoveStale remove
// what crashed runs left behind without touching those of live processes.
package netns

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Dir is where named namespaces are bind-mounted, as `ip netns` does.
const Dir = "/run/netns"

// NS is a named network namespace.
type NS struct {
	// Name is the file name under Dir.
	Name string
	// Path is the bind mount: use it with `nsenter --net=PATH`.
	Path   string
	handle vnetns.NsHandle
	nl     *netlink.Handle
}

// cleanIPv4 are the kernel's defaults for the IPv4 settings a new
// namespace copies from the host's (net.core.devconf_inherit_init_net 0,
// the default, copies net.ipv4.conf.{all,default}.* from the root
// namespace): a Docker host or a Kubernetes node has forwarding on, and
// many set rp_filter, accept_local, route_localnet or the ARP knobs.
// Create writes them, so a namespace starts the same on every host and its
// user sets what it needs. Settings a new namespace does not copy (ip_local_port_range, the
// TCP knobs, net.bridge.*) start at the kernel's defaults anyway.
var cleanIPv4 = [][2]string{
	{"net.ipv4.ip_forward", "0"}, // also conf.{all,default}.forwarding
	{"net.ipv4.conf.all.rp_filter", "0"},
	{"net.ipv4.conf.default.rp_filter", "0"},
	{"net.ipv4.conf.all.accept_local", "0"},
	{"net.ipv4.conf.default.accept_local", "0"},
	{"net.ipv4.conf.all.route_localnet", "0"},
	{"net.ipv4.conf.default.route_localnet", "0"},
	{"net.ipv4.conf.all.proxy_arp", "0"},
	{"net.ipv4.conf.default.proxy_arp", "0"},
	{"net.ipv4.conf.all.src_valid_mark", "0"},
	{"net.ipv4.conf.default.src_valid_mark", "0"},
	{"net.ipv4.conf.all.arp_ignore", "0"}, // IPVS and kube-vip hosts set 1
	{"net.ipv4.conf.default.arp_ignore", "0"},
	{"net.ipv4.conf.all.arp_announce", "0"},
	{"net.ipv4.conf.default.arp_announce", "0"},
	{"net.ipv4.conf.all.arp_filter", "0"},
	{"net.ipv4.conf.default.arp_filter", "0"},
}

// Create creates the named namespace with loopback up and the IPv4
// settings of a clean host (cleanIPv4), whatever the host's are. On error
// nothing is left behind.
func Create(name string) (_ *NS, err error) {
	ns := &NS{Name: name, Path: filepath.Join(Dir, name), handle: vnetns.None()}
	err = onThread(func() error {
		// NewNamed moves the thread into the new namespace; onThread
		// moves it back.
		h, err := vnetns.NewNamed(name)
		if err == nil {
			ns.handle = h
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, ns.Delete())
		}
	}()
	if ns.nl, err = netlink.NewHandleAt(ns.handle); err != nil {
		return nil, fmt.Errorf("netns %s: netlink handle: %w", name, err)
	}
	for _, kv := range cleanIPv4 {
		if err := ns.Sysctl(kv[0], kv[1]); err != nil {
			return nil, err
		}
	}
	if err := ns.LinkUp("lo"); err != nil {
		return nil, err
	}
	return ns, nil
}

// Delete removes the namespace's name and releases this package's
// references; the kernel destroys the namespace, with its interfaces,
// once no process or socket holds it. Deleting twice is not an error.
func (ns *NS) Delete() error {
	if ns.nl != nil {
		ns.nl.Close()
		ns.nl = nil
	}
	if ns.handle.IsOpen() {
		ns.handle.Close()
		ns.handle = vnetns.None()
	}
	return DeleteNamed(ns.Path)
}

// DeleteNamed unmounts and removes a named namespace's file; a missing
// one is not an error.
func DeleteNamed(path string) error {
	err := unix.Unmount(path, unix.MNT_DETACH)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount netns %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		if errors.Is(err, unix.EBUSY) {
			// The file is still a mount point, but not in the mount we
			// reach by path: a later bind mount of Dir onto itself (as
			// "ip netns add" makes when Dir is not yet one) hides it.
			return fmt.Errorf("remove netns %s: %w (still mounted under a later mount of %s; \"umount %s\" once, then remove it)", path, err, Dir, Dir)
		}
		return fmt.Errorf("remove netns %s: %w", path, err)
	}
	return nil
}

// RemoveStale deletes the namespaces under Dir named prefix+"<pid>-..."
// whose process no longer exists: leftovers of crashed or killed runs.
// Namespaces of this process and of live processes are left alone.
func RemoveStale(prefix string) error {
	entries, err := os.ReadDir(Dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list %s: %w", Dir, err)
	}
	var errs []error
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), prefix)
		if !ok {
			continue
		}
		pid, ok := OwnerPID(rest)
		if !ok || ProcessAlive(pid) {
			continue
		}
		if err := DeleteNamed(filepath.Join(Dir, e.Name())); err != nil {
			errs = append(errs, fmt.Errorf("remove stale netns: %w", err))
		}
	}
	return errors.Join(errs...)
}

// OwnerPID parses the pid of "<pid>-...". It reports false when s does not
// start with a positive number and a dash, and for this process's own pid
// (whose leftovers are never stale).
func OwnerPID(s string) (int, bool) {
	pidStr, _, found := strings.Cut(s, "-")
	pid, err := strconv.Atoi(pidStr)
	if !found || err != nil || pid <= 0 || pid == os.Getpid() {
		return 0, false
	}
	return pid, true
}

// ProcessAlive reports whether pid exists and is not a zombie (a killed
// process whose parent has not reaped it yet holds nothing).
func ProcessAlive(pid int) bool {
	if err := unix.Kill(pid, 0); err != nil && !errors.Is(err, unix.EPERM) {
		return false
	}
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true
	}
	// "pid (comm) S ...": the state follows the last ')'.
	if i := strings.LastIndexByte(string(stat), ')'); i >= 0 && i+2 < len(stat) {
		return stat[i+2] != 'Z'
	}
	return true
}

// onThread runs fn on an OS thread locked to it, and afterwards puts the
// thread back into the network namespace it started in; fn may switch the
// thread's namespace. A thread that cannot be put back stays locked and
// exits with its goroutine, so it never runs other goroutines in the wrong
// namespace.
func onThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := vnetns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("current netns: %w", err)
			return
		}
		defer orig.Close()
		err = fn()
		if restore := vnetns.Set(orig); restore != nil {
			err = errors.Join(err, fmt.Errorf("return to the original netns: %w", restore))
		} else {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// enter runs fn on a thread locked inside target; name is for errors.
func enter(target vnetns.NsHandle, name string, fn func() error) error {
	return onThread(func() error {
		if err := vnetns.Set(target); err != nil {
			return fmt.Errorf("enter netns %s: %w", name, err)
		}
		return fn()
	})
}

// Do runs fn on an OS thread locked inside the namespace. Sockets fn
// creates belong to the namespace for good and may be used from any
// goroutine afterwards.
func (ns *NS) Do(fn func() error) error { return enter(ns.handle, ns.Name, fn) }

// RunIn runs fn on an OS thread locked inside the network namespace bound
// at path (a named namespace, or /proc/PID/ns/net). Only the network
// namespace changes: the mount namespace, and with it bpffs pins, stays.
func RunIn(path string, fn func() error) error {
	target, err := vnetns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()
	return enter(target, path, fn)
}

// Netlink returns a netlink handle that operates inside the namespace.
func (ns *NS) Netlink() *netlink.Handle { return ns.nl }
