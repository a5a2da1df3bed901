package agent

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Attacher attaches the datapath's programs to interfaces; maps.Datapath
// implements it.
type Attacher interface {
	AttachPod(ifname string) error
	AttachUplink(ifname string) error
	Detach(ifname string) error
}

// Interfaces attaches the tc programs to pod interfaces and the uplink
// programs (XDP and its tc companion) to uplinks. With Auto set for pods,
// it follows veths that appear and
// disappear through a netlink subscription.
type Interfaces struct {
	DP  Attacher
	Log *slog.Logger
	// Uplinks are the uplink interface names ("auto" resolved).
	Uplinks []string
	// Pods are the pod interface names when not automatic.
	Pods []string
	// AutoPods attaches to the host side of every veth that is not an
	// uplink, now and as they come and go.
	AutoPods bool
}

// ParseInterfaces resolves the --uplinks and --pod-interfaces flag values.
func ParseInterfaces(uplinks, pods string) (up []string, podList []string, autoPods bool, err error) {
	if uplinks == "auto" {
		up, err = DefaultRouteDevices()
		if err != nil {
			return nil, nil, false, err
		}
	} else {
		up = splitList(uplinks)
	}
	if pods == "auto" {
		return up, nil, true, nil
	}
	return up, splitList(pods), false, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// DefaultRouteDevices returns the devices of the IPv4 default routes.
func DefaultRouteDevices() ([]string, error) {
	routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("list routes: %w", err)
	}
	var out []string
	for _, r := range routes {
		if r.Dst != nil {
			if ones, _ := r.Dst.Mask.Size(); ones != 0 {
				continue
			}
		}
		idx := r.LinkIndex
		if idx == 0 && len(r.MultiPath) > 0 {
			for _, nh := range r.MultiPath {
				if l, err := netlink.LinkByIndex(nh.LinkIndex); err == nil && !slices.Contains(out, l.Attrs().Name) {
					out = append(out, l.Attrs().Name)
				}
			}
			continue
		}
		l, err := netlink.LinkByIndex(idx)
		if err != nil {
			return nil, fmt.Errorf("default route device %d: %w", idx, err)
		}
		if !slices.Contains(out, l.Attrs().Name) {
			out = append(out, l.Attrs().Name)
		}
	}
	return out, nil
}

// Attach attaches to every configured interface. With AutoPods it then
// follows veth changes until ctx is done; the returned error covers only the
// initial attachment.
func (i *Interfaces) Attach(ctx context.Context) error {
	for _, up := range i.Uplinks {
		if err := i.DP.AttachUplink(up); err != nil {
			return fmt.Errorf("attach to uplink %s: %w", up, err)
		}
		i.Log.Info("attached uplink", "interface", up)
	}
	if !i.AutoPods {
		for _, p := range i.Pods {
			if err := i.DP.AttachPod(p); err != nil {
				return fmt.Errorf("attach tc to %s: %w", p, err)
			}
			i.Log.Info("attached tc", "interface", p)
		}
		return nil
	}
	// Subscribe before listing so no veth created in between is missed.
	updates := make(chan netlink.LinkUpdate, 256)
	done := make(chan struct{})
	if err := netlink.LinkSubscribeWithOptions(updates, done, netlink.LinkSubscribeOptions{
		ErrorCallback: func(err error) {
			if ctx.Err() == nil {
				i.Log.Error("link subscription", "err", err)
			}
		},
	}); err != nil {
		return fmt.Errorf("subscribe to link changes: %w", err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		close(done)
		return fmt.Errorf("list links: %w", err)
	}
	for _, l := range links {
		i.linkUp(l)
	}
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case u, ok := <-updates:
				if !ok {
					return
				}
				if u.Header.Type == unix.RTM_DELLINK {
					if i.isPod(u.Link) {
						if err := i.DP.Detach(u.Link.Attrs().Name); err != nil {
							i.Log.Error("detach tc", "interface", u.Link.Attrs().Name, "err", err)
						}
					}
					continue
				}
				i.linkUp(u.Link)
			}
		}
	}()
	return nil
}

func (i *Interfaces) isPod(l netlink.Link) bool {
	return l.Type() == "veth" && !slices.Contains(i.Uplinks, l.Attrs().Name)
}

// linkUp attaches tc to a pod veth; attaching again is harmless.
func (i *Interfaces) linkUp(l netlink.Link) {
	if !i.isPod(l) {
		return
	}
	name := l.Attrs().Name
	if err := i.DP.AttachPod(name); err != nil {
		i.Log.Error("attach tc", "interface", name, "err", err)
		return
	}
	i.Log.Debug("attached tc", "interface", name)
}
