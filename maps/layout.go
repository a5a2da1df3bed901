package maps

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// layoutVersion names the layout of every pinned map and the slot scheme
// the mirror relies on. It changes with layoutFingerprint: a change to a
// map's type, flags, key or value (bpf/structs.h, bpf/maps.h) or to an enum
// whose values maps store changes the fingerprint, and layout_test.go
// fails until layoutVersion is bumped and the pair recorded in
// testdata/layout_history. Load refuses maps of another version or
// fingerprint.
const layoutVersion = 9

// fingerprintEnums are the enums whose values the maps store. stat_reason
// (append-only, sized by STAT_SLOTS), map_size and ct_timeout are not part
// of the layout.
var fingerprintEnums = []string{
	"backend_flag", "backend_state", "svc_flag", "scope",
	"ct_dir", "ct_state", "ct_flag", "ct_redirect", "iface_kind",
}

// layoutFingerprint derives a fingerprint of the layout from the BTF of
// spec: every shared map's type, flags, key and value types, and the
// enums whose values the maps hold. Sizes (max_entries) are not part of it:
// adopting maps of other sizes fails on its own (ErrLayoutMismatch).
func layoutFingerprint(spec *ebpf.CollectionSpec) (uint64, error) {
	desc, err := layoutDescription(spec)
	if err != nil {
		return 0, err
	}
	sum := sha256.Sum256([]byte(desc))
	return binary.LittleEndian.Uint64(sum[:8]), nil
}

// layoutDescription is the canonical text the fingerprint hashes.
func layoutDescription(spec *ebpf.CollectionSpec) (string, error) {
	var b strings.Builder
	for _, name := range sharedMaps {
		m := spec.Maps[name]
		if m == nil {
			return "", fmt.Errorf("map %s missing from the object", name)
		}
		fmt.Fprintf(&b, "map %s type=%s flags=%#x key=", name, m.Type, m.Flags)
		describeType(&b, m.Key)
		b.WriteString(" value=")
		describeType(&b, m.Value)
		b.WriteString("\n")
	}
	for _, name := range fingerprintEnums {
		var e *btf.Enum
		if err := spec.Types.TypeByName(name, &e); err != nil {
			return "", fmt.Errorf("enum %s: %w", name, err)
		}
		describeType(&b, e)
		b.WriteString("\n")
	}
	return b.String(), nil
}

// describeType writes a canonical description of t: names, sizes,
// offsets and values, everything that decides how bytes are read.
func describeType(b *strings.Builder, t btf.Type) {
	switch t := t.(type) {
	case nil:
		b.WriteString("none")
	case *btf.Int:
		fmt.Fprintf(b, "int(%s,%d,%s)", t.Name, t.Size, t.Encoding)
	case *btf.Typedef:
		fmt.Fprintf(b, "%s=", t.Name)
		describeType(b, t.Type)
	case *btf.Volatile:
		b.WriteString("volatile ")
		describeType(b, t.Type)
	case *btf.Const:
		b.WriteString("const ")
		describeType(b, t.Type)
	case *btf.Array:
		fmt.Fprintf(b, "[%d]", t.Nelems)
		describeType(b, t.Type)
	case *btf.Enum:
		fmt.Fprintf(b, "enum %s(%d,signed=%t){", t.Name, t.Size, t.Signed)
		for _, v := range t.Values {
			fmt.Fprintf(b, "%s=%d;", v.Name, v.Value)
		}
		b.WriteString("}")
	case *btf.Struct:
		fmt.Fprintf(b, "struct %s(%d){", t.Name, t.Size)
		for _, m := range t.Members {
			fmt.Fprintf(b, "%s@%d:%d ", m.Name, m.Offset, m.BitfieldSize)
			describeType(b, m.Type)
			b.WriteString(";")
		}
		b.WriteString("}")
	default:
		fmt.Fprintf(b, "%T(%s)", t, t.TypeName())
	}
}
