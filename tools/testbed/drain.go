package testbed

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
)

// streamTries bounds the connections OpenStream makes to land one on a
// given backend.
const streamTries = 64

// OpenStream opens TCP keep-alive connections from client to the TCP port
// of service (its cluster IP, as the client's node decides) until one
// lands on pod, closes the others, and returns it with the frontend.
func (tb *traffic) OpenStream(ctx context.Context, client *Pod, service, pod string) (*Conn, error) {
	return tb.OpenStreamOf(ctx, client, service, pod, "")
}

// OpenStreamOf is OpenStream to the cluster IP of family ("": the
// Service's first).
func (tb *traffic) OpenStreamOf(ctx context.Context, client *Pod, service, pod string, family v1.IPFamily) (*Conn, error) {
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, client.Node.Name)
	d := FindDecisionOf(ds, service, v1.ProtocolTCP, family)
	if d == nil {
		return nil, fmt.Errorf("service %s has no %s TCP port", service, family)
	}
	for range streamTries {
		c, err := client.Open(ctx, v1.ProtocolTCP, d.Frontend)
		if err != nil {
			return nil, err
		}
		a, err := c.Ask(ctx)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("stream to %s: %w", d.Frontend, err)
		}
		if a.Pod == pod {
			return c, nil
		}
		c.Close()
	}
	return nil, fmt.Errorf("no stream to %s landed on %s in %d tries", d.Frontend, pod, streamTries)
}

// StreamStays asks the stream n times, 50 ms apart, and returns an error
// unless every answer comes from pod: a drain keeps established flows.
func StreamStays(ctx context.Context, c *Conn, pod string, n int) error {
	for i := range n {
		a, err := c.Ask(ctx)
		switch {
		case err != nil:
			return fmt.Errorf("stream on %s broke at ask %d: %w", pod, i+1, err)
		case a.Pod != pod:
			return fmt.Errorf("stream on %s moved to %s at ask %d", pod, a.Pod, i+1)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// EnterScenario applies a scenario's Services for a measurement of new
// flows: the previous state's flows are forgotten first (ForgetFlows), and
// for a drain scenario a stream is then opened on the drained backend,
// before the change. wait, if not nil, runs after the apply (for example
// WaitAgents). It returns the scenario and the stream, nil without a drain;
// the caller checks the stream (StreamStays) and closes it.
func (tb *traffic) EnterScenario(ctx context.Context, name string, wait func() error) (*Scenario, *Conn, error) {
	sc, err := tb.Spec.Scenario(name)
	if err != nil {
		return nil, nil, err
	}
	if err := tb.ForgetFlows(); err != nil {
		return nil, nil, err
	}
	var stream *Conn
	if d := sc.Drain; d != nil {
		client := tb.Pod(d.Client)
		if stream, err = tb.OpenStream(ctx, client, d.Service, d.Pod); err != nil {
			return nil, nil, fmt.Errorf("scenario %s: %w", name, err)
		}
	}
	fail := func(err error) (*Scenario, *Conn, error) {
		if stream != nil {
			stream.Close()
		}
		return nil, nil, err
	}
	if _, err := tb.Apply(ctx, sc.Services); err != nil {
		return fail(err)
	}
	if wait != nil {
		if err := wait(); err != nil {
			return fail(err)
		}
	}
	return sc, stream, nil
}
