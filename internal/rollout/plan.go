// Package rollout plans a KV-revision rollout of both pools at once: the update revision's
// prefill and decode are scaled up before the older revisions' are scaled down, within
// maxSurge and maxUnavailable per pool, and an older revision keeps at least one pod in each
// pool until its other pool goes too: the router, which pairs prefill and decode within a
// revision, always has a revision to send a request to, and no revision is left with one pool
// only.
//
// Plan is pure: the reconciler gives it what each revision's Deployments ask and have ready,
// and applies the step it returns; readiness arriving moves the next step on.
package rollout

// Counts are replicas per pool.
type Counts struct {
	Prefill int32 `json:"prefill"`
	Decode  int32 `json:"decode"`
}

func (c Counts) get(prefill bool) int32 {
	if prefill {
		return c.Prefill
	}
	return c.Decode
}

func (c *Counts) set(prefill bool, v int32) {
	if prefill {
		c.Prefill = v
	} else {
		c.Decode = v
	}
}

// Revision is one KV revision's pair of Deployments.
type Revision struct {
	Name string
	// Replicas is what its Deployments ask now; Ready what they have ready.
	Replicas, Ready Counts
}

// Input is the state a step is planned from.
type Input struct {
	// Target is what the pools should run once the rollout is done (the effective counts).
	Target Counts
	// MaxSurge is how many pods per pool may run above Target; MaxUnavailable how many below
	// Target may be not ready (both resolved against Target, as a Deployment resolves them).
	// Both 0 is read as MaxSurge 1.
	MaxSurge, MaxUnavailable Counts
	// Update is the update revision; Old the older revisions still running, oldest first.
	Update Revision
	Old    []Revision
}

// Step is what each revision's Deployments should ask next.
type Step struct {
	Update Counts
	Old    []Counts
	// Done: nothing older runs and the update revision is ready at Target.
	Done bool
}

// Plan returns the next step of the rollout.
func Plan(in Input) Step {
	surge, unavailable := in.MaxSurge, in.MaxUnavailable
	for _, prefill := range []bool{true, false} {
		if surge.get(prefill) == 0 && unavailable.get(prefill) == 0 {
			surge.set(prefill, 1)
		}
	}
	step := Step{Update: in.Update.Replicas, Old: make([]Counts, len(in.Old))}
	for i, o := range in.Old {
		step.Old[i] = o.Replicas
	}
	for _, prefill := range []bool{true, false} {
		target := in.Target.get(prefill)
		var oldTotal, oldReady int32
		for _, o := range in.Old {
			oldTotal += o.Replicas.get(prefill)
			oldReady += o.Ready.get(prefill)
		}
		// Up: the update revision grows within the surge (never above Target, never shrinks
		// below what it asks unless Target went down).
		up := min(target, max(in.Update.Replicas.get(prefill), target+surge.get(prefill)-oldTotal))
		step.Update.set(prefill, up)
		// Down: as a Deployment scales its old ReplicaSets down, keep at least Target -
		// MaxUnavailable ready, counting the update revision's ready pods; pods that are not
		// ready go first (they serve nothing), oldest revision first.
		minAvailable := target - unavailable.get(prefill)
		removable := max(0, oldTotal+in.Update.Ready.get(prefill)-minAvailable-(oldTotal-oldReady))
		for i := range in.Old {
			o := in.Old[i]
			n := o.Replicas.get(prefill)
			notReady := n - min(n, o.Ready.get(prefill))
			n -= notReady
			cut := min(n, removable)
			removable -= cut
			step.Old[i].set(prefill, n-cut)
		}
	}
	// Pairs: an older revision serves only while it has both pools (the router never pairs
	// across revisions). One that has lost a pool already serves nothing and goes whole; in
	// the others a pool reaches 0 only with its partner, so a pool's budget spent first does
	// not strand the other's pods without a partner.
	for i, o := range in.Old {
		s := &step.Old[i]
		switch {
		case o.Replicas.Prefill == 0 || o.Replicas.Decode == 0:
			*s = Counts{}
		case s.Prefill == 0 && s.Decode > 0:
			s.Prefill = 1
		case s.Decode == 0 && s.Prefill > 0:
			s.Decode = 1
		}
	}
	step.Done = step.Update == in.Target && in.Update.Ready == in.Target
	for _, o := range step.Old {
		step.Done = step.Done && o == Counts{}
	}
	return step
}
