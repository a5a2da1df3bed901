package netns

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// SNMP holds the counters of /proc/net/snmp by protocol ("Ip", "Tcp",
// "Udp", ...) and counter name ("InCsumErrors", "NoPorts", ...).
type SNMP map[string]map[string]uint64

// ParseSNMP reads the header/value line pairs of /proc/net/snmp. A value
// line without a header line before it, a header and value line of
// different lengths, or a value that is not a number is an error.
func ParseSNMP(r io.Reader) (SNMP, error) {
	out := SNMP{}
	sc := bufio.NewScanner(r)
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
		if len(fields) != len(header) {
			return nil, fmt.Errorf("snmp %s: %d values for %d names", proto, len(fields)-1, len(header)-1)
		}
		m := make(map[string]uint64, len(fields)-1)
		for i := 1; i < len(fields); i++ {
			// Most counters are unsigned; a few (Tcp MaxConn) are -1.
			v, err := strconv.ParseInt(fields[i], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("snmp %s %s: %w", proto, header[i], err)
			}
			m[header[i]] = uint64(v)
		}
		out[proto] = m
		header = nil
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read snmp: %w", err)
	}
	return out, nil
}

// Counter returns one counter; a missing one is an error, never 0.
func (s SNMP) Counter(proto, name string) (uint64, error) {
	v, ok := s[proto][name]
	if !ok {
		return 0, fmt.Errorf("snmp has no counter %s %s", proto, name)
	}
	return v, nil
}

// SNMP reads /proc/net/snmp as seen from inside the namespace.
func (ns *NS) SNMP() (SNMP, error) {
	var s SNMP
	err := ns.Do(func() error {
		// thread-self, not self: the namespace is the calling thread's.
		f, err := os.Open("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		defer f.Close()
		s, err = ParseSNMP(f)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s: read snmp counters: %w", ns.Name, err)
	}
	return s, nil
}

// counter reads one SNMP counter of the namespace.
func (ns *NS) counter(proto, name string) (uint64, error) {
	s, err := ns.SNMP()
	if err != nil {
		return 0, err
	}
	v, err := s.Counter(proto, name)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", ns.Name, err)
	}
	return v, nil
}

// ChecksumErrors are a namespace's receive checksum error counters, as
// `nstat` shows them (Udp InCsumErrors, Tcp InCsumErrors). A datapath that
// writes a wrong checksum makes them grow when the senders on its path
// have transmit checksum offload off.
type ChecksumErrors struct {
	UDP uint64
	TCP uint64
}

// ChecksumErrors reads the namespace's receive checksum error counters.
func (ns *NS) ChecksumErrors() (ChecksumErrors, error) {
	s, err := ns.SNMP()
	if err != nil {
		return ChecksumErrors{}, err
	}
	var c ChecksumErrors
	if c.UDP, err = s.Counter("Udp", "InCsumErrors"); err != nil {
		return ChecksumErrors{}, fmt.Errorf("%s: %w", ns.Name, err)
	}
	if c.TCP, err = s.Counter("Tcp", "InCsumErrors"); err != nil {
		return ChecksumErrors{}, fmt.Errorf("%s: %w", ns.Name, err)
	}
	return c, nil
}

// UDPNoPorts reads the namespace's Udp NoPorts counter: datagrams that
// arrived for a port nothing listens on.
func (ns *NS) UDPNoPorts() (uint64, error) { return ns.counter("Udp", "NoPorts") }

// Growth returns after - before for a counter read twice. A counter that
// went down (it wrapped, or the two reads are of different namespaces) is
// an error, never a huge unsigned difference.
func Growth(before, after uint64) (uint64, error) {
	if after < before {
		return 0, fmt.Errorf("counter went down from %d to %d", before, after)
	}
	return after - before, nil
}
