package controllers

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// clientSteps are the functions of this package that may use the API client (and the
// reconciler's other windows on the cluster: APIReader, RESTMapper), and the step each
// belongs to. A reconcile observes once, decides in pure functions, then acts: a function
// that reads or writes the cluster and is not listed here is a read hidden in a decision, or
// a write outside act.
var clientSteps = map[string]string{
	"Reconcile":             "observe (the PDCluster itself) and act (its status, once)",
	"observeSnapshot":       "observe",
	"observeTopology":       "observe",
	"listOptional":          "observe",
	"createPoolScales":      "act",
	"reconcileObject":       "act", // reads the object it applies, to compare
	"apply":                 "act",
	"stepOldRevisions":      "act",
	"pinService":            "act",
	"deleteObserved":        "act",
	"writeScaleStatus":      "act",
	"decideConnectorHealth": "act", // restarts, after checking the PDCluster read is current
	"restartPods":           "act",
	"setDeletionCosts":      "act",
	"labelDomains":          "act",
}

// decisions are the reconcile's pure steps: they see the snapshot and the spec, never the
// client, and call no step that does.
var decisions = []string{"decide", "prepare", "multiNodeUnavailable", "revisionsOf", "decideScale", "planRollout", "keepSet", "unused", "observed", "computeStatus"}

// clientMethods are the client's methods (and the reconciler's other windows on the cluster).
var clientMethods = map[string]bool{"Get": true, "List": true, "Create": true, "Update": true, "Patch": true, "Delete": true,
	"DeleteAllOf": true, "Apply": true, "Status": true, "SubResource": true, "RESTMapper": true}

// The client is used by the observe and act steps only, as cmd/binaries_test.go checks what
// each binary links: read from the source, so a new read or write lands in a step on purpose.
func TestTheClientIsUsedOnlyToObserveAndAct(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	uses := map[string][]string{}  // function -> client calls
	calls := map[string][]string{} // function -> functions of this package it calls
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			name := fd.Name.Name
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				switch fn := call.Fun.(type) {
				case *ast.Ident:
					calls[name] = append(calls[name], fn.Name)
				case *ast.SelectorExpr:
					calls[name] = append(calls[name], fn.Sel.Name)
					if onReconciler(fn.X) && clientMethods[fn.Sel.Name] {
						uses[name] = append(uses[name], fset.Position(call.Pos()).String())
					}
				}
				return true
			})
		}
	}
	for fn, at := range uses {
		if _, ok := clientSteps[fn]; !ok {
			t.Errorf("%s uses the client (%s) and is not an observe or act step: move the read into the snapshot or the write into act, or list it in clientSteps", fn, strings.Join(at, ", "))
		}
	}
	for fn := range clientSteps {
		if len(uses[fn]) == 0 {
			t.Errorf("clientSteps lists %s, which does not use the client (renamed or gone?)", fn)
		}
	}
	for _, fn := range decisions {
		if _, ok := calls[fn]; !ok {
			t.Errorf("decision %s not found", fn)
		}
		if len(uses[fn]) > 0 {
			t.Errorf("decision %s uses the client: %s", fn, strings.Join(uses[fn], ", "))
		}
		for _, callee := range calls[fn] {
			if _, ok := clientSteps[callee]; ok && !slices.Contains(decisions, callee) {
				t.Errorf("decision %s calls %s, an %s step", fn, callee, clientSteps[callee])
			}
		}
	}
}

// onReconciler reports whether x is the reconciler (r) or one of its fields (r.APIReader).
func onReconciler(x ast.Expr) bool {
	switch e := x.(type) {
	case *ast.Ident:
		return e.Name == "r"
	case *ast.SelectorExpr:
		return onReconciler(e.X)
	}
	return false
}
