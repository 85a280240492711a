package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/launch"
)

// launchOptions are `connector launch`'s flags; the command to exec follows "--".
type launchOptions struct {
	layout         string
	localRanks     int
	port           int
	resolveTimeout time.Duration
	command        []string
}

func parseLaunchFlags(args []string, stderr io.Writer) (launchOptions, error) {
	var o launchOptions
	fs := flag.NewFlagSet("connector launch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.layout, "layout", "", "how the replica spreads over its pods: data-parallel or model")
	fs.IntVar(&o.localRanks, "local-ranks", 0, "data-parallel ranks per pod (layout data-parallel)")
	fs.IntVar(&o.port, "port", 0, "the leader's data-parallel RPC port (data-parallel) or master port (model)")
	fs.DurationVar(&o.resolveTimeout, "resolve-timeout", 5*time.Minute, "how long to wait for the leader's address to resolve")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	o.command = fs.Args()
	if len(o.command) == 0 {
		return o, errors.New("no command: want connector launch [flags] -- vllm serve <args>")
	}
	return o, nil
}

// launchMain is `connector launch`: it resolves this pod's place in its LeaderWorkerSet group
// and execs the command (vllm serve ...) with the layout's flags and side-channel variables
// appended. It returns only on failure, with the exit code.
func launchMain(args []string, stderr io.Writer) int {
	o, err := parseLaunchFlags(args, stderr)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, err)
		}
		return 2
	}
	argv, env, err := launchCommand(context.Background(), o, os.Getenv, net.DefaultResolver.LookupHost)
	if err != nil {
		fmt.Fprintln(stderr, "connector launch:", err)
		return 1
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		fmt.Fprintln(stderr, "connector launch:", err)
		return 1
	}
	err = syscall.Exec(path, argv, launchEnv(os.Environ(), env))
	fmt.Fprintln(stderr, "connector launch: exec", path+":", err)
	return 1
}

// launchEnv is environ with extra's variables in place of any of the same name: the engine's
// Python would read the first of two.
func launchEnv(environ, extra []string) []string {
	replaced := map[string]bool{}
	for _, kv := range extra {
		name, _, _ := strings.Cut(kv, "=")
		replaced[name] = true
	}
	out := slices.DeleteFunc(slices.Clone(environ), func(kv string) bool {
		name, _, _ := strings.Cut(kv, "=")
		return replaced[name]
	})
	return append(out, extra...)
}

// launchCommand is the command line and the extra environment launchMain execs.
func launchCommand(ctx context.Context, o launchOptions, getenv func(string) string, resolve launch.Resolver) ([]string, []string, error) {
	g, err := launch.FromEnv(getenv, launch.Layout(o.layout), o.localRanks, o.port)
	if err != nil {
		return nil, nil, err
	}
	leader, err := launch.ResolveLeader(ctx, resolve, g.Leader, o.resolveTimeout, time.Second)
	if err != nil {
		return nil, nil, err
	}
	return append(append([]string(nil), o.command...), g.Args(leader)...), g.Env(), nil
}
