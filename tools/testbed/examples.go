package testbed

import _ "embed"

var (
	//go:embed examples/demo.yaml
	demoYAML []byte
	//go:embed examples/every-node.yaml
	everyNodeYAML []byte
	//go:embed examples/dual-stack.yaml
	dualStackYAML []byte
)

// DualStackSpec returns the parsed examples/dual-stack.yaml: the
// dual-stack part of `make demo`, a Service whose two families decide
// different modes.
func DualStackSpec() (*Spec, error) { return ParseSpec(dualStackYAML) }

// DemoYAML returns examples/demo.yaml: the testbed of `make demo` and of
// the end-to-end tests.
func DemoYAML() []byte { return demoYAML }

// DemoSpec returns the parsed examples/demo.yaml.
func DemoSpec() (*Spec, error) { return ParseSpec(demoYAML) }

// EveryNodeSpec returns the parsed examples/every-node.yaml: a client on
// every node and one Service per policy.
func EveryNodeSpec() (*Spec, error) { return ParseSpec(everyNodeYAML) }
