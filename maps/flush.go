package maps

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// FlushFlows forgets every flow of the datapath pinned at pinPath: its
// conntrack entries of both families and its ClientIP affinities. Every flow is balanced
// afresh on its next packet, so an established connection whose backend is
// no longer the one its hash picks is reset. It opens the pinned maps
// directly and does not take the directory's lock: the agent that owns the
// datapath keeps running. For tests that need fresh flows (a reused UDP
// source port is the same flow, and keeps a draining backend) and for
// operators who mean it. It returns the number of entries deleted.
func FlushFlows(pinPath string) (int, error) {
	total := 0
	for _, name := range []string{tcMapTlbConntrack, tcMapTlbCtNew, tcMapTlbCt6, tcMapTlbCt6New, tcMapTlbAffinity} {
		n, err := flushPinned(filepath.Join(pinPath, name))
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// flushPinned deletes every entry of the hash map pinned at path.
func flushPinned(path string) (int, error) {
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		return 0, fmt.Errorf("open pinned %s: %w", path, err)
	}
	defer m.Close()
	var keys [][]byte
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, append([]byte(nil), k...))
	}
	if err := it.Err(); err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	n := 0
	for _, key := range keys {
		if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, fmt.Errorf("delete from %s: %w", path, err)
		}
		n++
	}
	return n, nil
}
