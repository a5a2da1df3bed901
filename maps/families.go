package maps

// IPv6 reports whether the datapath serves IPv6 frontends and backends.
// It does not yet: SetService refuses IPv6 addresses (validIPv4), and the
// agent programs only the IPv4 half of its decisions while it says so.
// The IPv6 datapath replaces this with the real answer.
func (d *Datapath) IPv6() bool { return false }
