package testbed

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// ChecksumErrors are a namespace's receive checksum error counters, as
// `nstat` shows them (Udp InCsumErrors, Tcp InCsumErrors). A datapath that
// writes a wrong checksum makes them grow, because the wire's senders have
// checksum offload off.
type ChecksumErrors struct {
	UDP uint64
	TCP uint64
}

// ChecksumErrors reads /proc/net/snmp as seen from inside the namespace.
func (ns *NS) ChecksumErrors() (ChecksumErrors, error) {
	var c ChecksumErrors
	err := ns.Do(func() error {
		f, err := openSNMP()
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
	if err != nil {
		return c, fmt.Errorf("%s: read snmp counters: %w", ns.Name, err)
	}
	return c, nil
}

// parseSNMP reads the header/value line pairs of /proc/net/snmp.
func parseSNMP(r io.Reader) (map[string]map[string]uint64, error) {
	out := make(map[string]map[string]uint64)
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

// ChecksumErrors returns the non-zero checksum error counters of every
// namespace of the testbed, by namespace name.
func (tb *Testbed) ChecksumErrors() (map[string]ChecksumErrors, error) {
	out := map[string]ChecksumErrors{}
	for _, ns := range tb.namespaces() {
		c, err := ns.ChecksumErrors()
		if err != nil {
			return nil, err
		}
		if c != (ChecksumErrors{}) {
			out[ns.Name] = c
		}
	}
	return out, nil
}

// openSNMP opens /proc/net/snmp of the calling thread's namespace.
func openSNMP() (*os.File, error) { return os.Open("/proc/thread-self/net/snmp") }
