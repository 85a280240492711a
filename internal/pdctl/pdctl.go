// Package pdctl implements the pdctl command line.
package pdctl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
	"pdcluster.dev/pdcluster-operator/internal/validation"
)

// Execute runs pdctl with args and returns the process exit code.
func Execute(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	root := NewRootCommand(stdin)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(stderr, "error:", err)
		return 1
	}
	return 0
}

// NewRootCommand builds the pdctl command tree.
func NewRootCommand(stdin io.Reader) *cobra.Command {
	root := &cobra.Command{
		Use:           "pdctl",
		Short:         "Work with PDCluster manifests: validate and render",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newValidateCommand(stdin), newRenderCommand(stdin))
	return root
}

func readInput(ctx context.Context, path string, stdin io.Reader) ([]validation.Document, error) {
	if path == "" {
		return nil, errors.New("-f FILE is required (use -f - for standard input)")
	}
	r := stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	loader, err := validation.NewLoader()
	if err != nil {
		return nil, err
	}
	docs, err := loader.Read(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return docs, nil
}

// Field validation, as kubectl's --field-validation: what an unknown field in a manifest does.
const (
	// FieldValidationStrict refuses the manifest, as kubectl apply (server-side strict field
	// validation) does by default.
	FieldValidationStrict = "Strict"
	// FieldValidationWarn says the field would be dropped and goes on.
	FieldValidationWarn = "Warn"
	// FieldValidationIgnore drops it silently.
	FieldValidationIgnore = "Ignore"
)

// unknownFields applies mode to the fields the API server would not keep: an error naming them
// (Strict), a warning each (Warn), or nothing (Ignore).
func unknownFields(w io.Writer, mode string, d validation.Document) error {
	if len(d.Pruned) == 0 || mode == FieldValidationIgnore {
		return nil
	}
	if mode == FieldValidationStrict {
		var errs []error
		for _, p := range d.Pruned {
			errs = append(errs, fmt.Errorf("unknown field %q", p))
		}
		return fmt.Errorf("PDCluster %q: strict decoding error (as kubectl apply; --field-validation=Warn to go on without them): %w", d.PDCluster.Name, errors.Join(errs...))
	}
	for _, p := range d.Pruned {
		fmt.Fprintf(w, "warning: %s/%s: unknown field %q would be dropped\n", d.PDCluster.Namespace, d.PDCluster.Name, p)
	}
	return nil
}

func fieldValidationFlag(cmd *cobra.Command, mode *string) {
	cmd.Flags().StringVar(mode, "field-validation", FieldValidationStrict,
		"what an unknown field does, as kubectl's flag: Strict (refuse the manifest, as kubectl apply does), Warn (say it would be dropped) or Ignore")
}

func checkFieldValidation(mode string) error {
	switch mode {
	case FieldValidationStrict, FieldValidationWarn, FieldValidationIgnore:
		return nil
	}
	return fmt.Errorf("--field-validation must be Strict, Warn or Ignore, not %q", mode)
}

func newValidateCommand(stdin io.Reader) *cobra.Command {
	var file, fields string
	cmd := &cobra.Command{
		Use:   "validate -f FILE",
		Short: "Default and validate PDClusters as the API server would; exit 1 on bad input",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkFieldValidation(fields); err != nil {
				return err
			}
			docs, err := readInput(cmd.Context(), file, stdin)
			if err != nil {
				return err
			}
			var errs []error
			for _, d := range docs {
				if err := unknownFields(cmd.ErrOrStderr(), fields, d); err != nil {
					errs = append(errs, err)
					continue
				}
				// The checks the CRD cannot make (the operator makes the same ones before it
				// applies anything), then a render, which must succeed for the operator too.
				if err := d.PDCluster.Validate().ToAggregate(); err != nil {
					errs = append(errs, fmt.Errorf("PDCluster %q is invalid: %w", d.PDCluster.Name, err))
					continue
				}
				if _, err := scaling.Initial(d.PDCluster); err != nil {
					errs = append(errs, fmt.Errorf("PDCluster %q is invalid: %w", d.PDCluster.Name, err))
					continue
				}
				if _, err := render.Render(d.PDCluster, render.DefaultOptions()); err != nil {
					errs = append(errs, fmt.Errorf("PDCluster %q is invalid: %w", d.PDCluster.Name, err))
					continue
				}
				for _, w := range d.PDCluster.Warnings() {
					fmt.Fprintf(cmd.ErrOrStderr(), "warning: %s/%s: %s\n", d.PDCluster.Namespace, d.PDCluster.Name, w)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "pdcluster/%s (namespace %s) is valid\n", d.PDCluster.Name, d.PDCluster.Namespace)
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().StringVarP(&file, "filename", "f", "", "manifest file (YAML or JSON, several documents allowed; - for stdin)")
	fieldValidationFlag(cmd, &fields)
	return cmd
}

func newRenderCommand(stdin io.Reader) *cobra.Command {
	var file, output, fields, servingFile string
	opts := render.DefaultOptions()
	cmd := &cobra.Command{
		Use:   "render -f FILE [-o yaml|json] [--serving FILE]",
		Short: "Print every object the operator would create for the PDClusters in FILE",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "yaml" && output != "json" {
				return fmt.Errorf("-o must be yaml or json, not %q", output)
			}
			if err := checkFieldValidation(fields); err != nil {
				return err
			}
			docs, err := readInput(cmd.Context(), file, stdin)
			if err != nil {
				return err
			}
			serving, err := readServing(servingFile)
			if err != nil {
				return err
			}
			var objs []render.Object
			for _, d := range docs {
				if err := unknownFields(cmd.ErrOrStderr(), fields, d); err != nil {
					return err
				}
				// What the operator creates first: each pool at its seed (an External pool's
				// PoolScale, which its scaler then writes, at the same count).
				pdc := d.PDCluster
				initial, err := scaling.Initial(pdc)
				if err != nil {
					return fmt.Errorf("PDCluster %q: %w", pdc.Name, err)
				}
				if serving != nil {
					// What a reconcile applied, from what it took of the cluster.
					o, err := render.RenderServing(scaling.Scaled(pdc, initial), opts, *serving)
					if err != nil {
						return fmt.Errorf("PDCluster %q: %w", pdc.Name, err)
					}
					objs = append(objs, o...)
					continue
				}
				o, err := render.Render(scaling.Scaled(pdc, initial), opts)
				if err != nil {
					return fmt.Errorf("PDCluster %q: %w", pdc.Name, err)
				}
				objs = append(objs, o...)
				for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
					if scaling.External(pdc, role) {
						objs = append(objs, render.PoolScale(pdc, role, scaling.Seed(pdc, role, nil)))
					}
				}
			}
			var out []byte
			if output == "json" {
				out, err = render.JSONList(objs)
			} else {
				out, err = render.YAML(objs)
			}
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(out)
			return err
		},
	}
	cmd.Flags().StringVarP(&file, "filename", "f", "", "manifest file (YAML or JSON; - for stdin)")
	cmd.Flags().StringVarP(&output, "output", "o", "yaml", "output format: yaml or json (a v1 List)")
	fieldValidationFlag(cmd, &fields)
	cmd.Flags().StringVar(&opts.RouterImage, "router-image", opts.RouterImage, "image of the P/D router, as the manager's --router-image")
	cmd.Flags().StringVar(&opts.ConnectorImage, "connector-image", opts.ConnectorImage, "image of the connector sidecar, as the manager's --connector-image")
	cmd.Flags().StringVar(&opts.OperatorNamespace, "operator-namespace", opts.OperatorNamespace, "namespace the operator runs in, as the manager's --operator-namespace (the NetworkPolicies admit its pods)")
	cmd.Flags().StringVar(&servingFile, "serving", "", "what a reconcile took of the cluster, as the manager logs it with each plan (\"planned\", serving=JSON, at --zap-log-level=debug): the older KV revisions that run, the topology domains, the rollout's step; renders exactly what that reconcile applied (no PoolScale: it is created once, not applied)")
	return cmd
}

// readServing reads --serving: JSON of render.Serving, unknown fields refused; nil when unset.
func readServing(path string) (*render.Serving, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--serving: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var s render.Serving
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("--serving %s: %w", path, err)
	}
	return &s, nil
}
