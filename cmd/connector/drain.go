package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/sidecar"
)

// drainOptions are `connector drain`'s flags: the sidecar's preStop hook.
type drainOptions struct {
	listen       string
	min, timeout time.Duration
}

func parseDrainFlags(args []string) (drainOptions, error) {
	var o drainOptions
	fs := flag.NewFlagSet("connector drain", flag.ContinueOnError)
	fs.StringVar(&o.listen, "listen", "unix:///var/run/pdcluster-ctl/ctl.sock", "the running sidecar's control socket (its --control-listen)")
	fs.DurationVar(&o.min, "min", 15*time.Second, "wait at least this long: the routers' window to stop sending to the pod")
	fs.DurationVar(&o.timeout, "timeout", 135*time.Second, "wait at most this long for the engine's held KV sends to reach 0")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.min < 0 || o.timeout < o.min {
		return o, fmt.Errorf("--min %s and --timeout %s: want 0 <= min <= timeout", o.min, o.timeout)
	}
	return o, nil
}

// drain asks the running sidecar to drain and waits for its answer.
func drain(ctx context.Context, o drainOptions) (sidecar.DrainResult, error) {
	base, hc := localapi.Client(o.listen, o.timeout+15*time.Second)
	q := url.Values{"min": {o.min.String()}, "timeout": {o.timeout.String()}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+localapi.PathDrain+"?"+q.Encode(), nil)
	if err != nil {
		return sidecar.DrainResult{}, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return sidecar.DrainResult{}, fmt.Errorf("drain through %s: %w", o.listen, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return sidecar.DrainResult{}, fmt.Errorf("drain through %s: %s: %s", o.listen, resp.Status, b)
	}
	var res sidecar.DrainResult
	if err := json.Unmarshal(b, &res); err != nil {
		return sidecar.DrainResult{}, fmt.Errorf("drain through %s: answer %q: %w", o.listen, b, err)
	}
	return res, nil
}

// drainMain is `connector drain`: the kubelet shows its output when it fails.
func drainMain(args []string, stdout, stderr io.Writer) int {
	o, err := parseDrainFlags(args)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, err)
		}
		return 2
	}
	res, err := drain(context.Background(), o)
	if err != nil {
		fmt.Fprintln(stderr, "connector drain:", err)
		return 1
	}
	fmt.Fprintf(stdout, "connector drain: %s after %.1fs (held KV sends %d)\n", res.Reason, res.WaitedSeconds, res.HeldSends)
	return 0
}
