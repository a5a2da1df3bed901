package testbed

import _ "embed"

//go:embed examples/demo.yaml
var demoYAML []byte

// DemoYAML returns examples/demo.yaml: the testbed of `make demo` and of
// the end-to-end tests.
func DemoYAML() []byte { return demoYAML }

// DemoSpec returns the parsed examples/demo.yaml.
func DemoSpec() (*Spec, error) { return ParseSpec(demoYAML) }
