package testbed

import _ "embed"

var (
	//go:embed examples/demo.yaml
	demoYAML []byte
	//go:embed examples/every-node.yaml
	everyNodeYAML []byte
)

// DemoYAML returns examples/demo.yaml: the testbed of `make demo` and of
// the end-to-end tests.
func DemoYAML() []byte { return demoYAML }

// DemoSpec returns the parsed examples/demo.yaml.
func DemoSpec() (*Spec, error) { return ParseSpec(demoYAML) }

// EveryNodeSpec returns the parsed examples/every-node.yaml: a client on
// every node and one Service per policy.
func EveryNodeSpec() (*Spec, error) { return ParseSpec(everyNodeYAML) }
