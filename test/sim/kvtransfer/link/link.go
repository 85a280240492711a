// Package link is the engine's side of the connector agent's local API: what vLLM's connector
// worker does in a pod, here for the engine simulator and the agent's tests.
package link

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
)

// ErrAgentLost fails the pulls and releases the holds an agent took with it when it restarted
// or stayed unreachable: its state is gone, so the engine must not wait for it.
var ErrAgentLost = errors.New("connector agent lost")

// releaseAgentLost is the reason of a hold the Link released because its agent was lost.
const releaseAgentLost kvtransfer.ReleaseReason = "agent-lost"

// Link is the engine's side of the local API, vLLM's connector worker: it forwards pulls and
// holds to the agent and delivers the agent's reports to the scheduler. It also keeps the
// engine safe from the agent's failures: every pull that notifies the scheduler is reported
// exactly once even if the agent dies (failed, as by the load-failure policy), and every held
// transfer is released exactly once.
type Link struct {
	base        string
	hc          *http.Client
	completions kvtransfer.CompletionSink
	releases    kvtransfer.ReleaseSink
	// LostAfter is how long the agent may stay unreachable before its state counts as lost.
	LostAfter time.Duration
	Log       logr.Logger

	mu    sync.Mutex
	epoch string // the agent run the Link last heard from
	pulls map[kvtransfer.RequestID]trackedPull
	held  map[kvtransfer.TransferID]trackedHold
	// lost are pulls the Link failed while their agent may still be alive (unreachable, or a
	// POST whose answer was lost): a late report for them is dropped.
	lost map[kvtransfer.RequestID]struct{}
}

type trackedPull struct {
	epoch  string
	blocks kvtransfer.BlockIDs
}

type trackedHold struct {
	epoch   string
	request kvtransfer.RequestID
	blocks  int
}

// New returns a Link to the agent's local API at endpoint (http://host:port or
// unix:///path). completions is required for a consumer engine, releases for a producer engine.
func New(endpoint string, completions kvtransfer.CompletionSink, releases kvtransfer.ReleaseSink) *Link {
	base, hc := localapi.Client(endpoint, 10*time.Second)
	return &Link{
		base: base, hc: hc, completions: completions, releases: releases,
		LostAfter: 5 * time.Second, Log: logr.Discard(),
		pulls: map[kvtransfer.RequestID]trackedPull{}, held: map[kvtransfer.TransferID]trackedHold{},
		lost: map[kvtransfer.RequestID]struct{}{},
	}
}

func (l *Link) post(ctx context.Context, path string, body any) (string, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.base+path, bytes.NewReader(b))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := l.hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrAgentLost, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode/100 != 2 {
		return "", fmt.Errorf("agent %s: %s: %s", path, resp.Status, bytes.TrimSpace(data))
	}
	var er agentapi.EpochReply
	_ = json.Unmarshal(data, &er)
	return er.Epoch, nil
}

// Pull hands a pull to the agent. A pull the agent did not take is failed at once when it
// notifies the scheduler, so the request never waits for a report that cannot come.
func (l *Link) Pull(ctx context.Context, p agentapi.Pull) error {
	notify := p.Meta().NotifiesScheduler()
	if notify {
		l.mu.Lock()
		l.pulls[p.Request] = trackedPull{epoch: "?", blocks: p.Blocks.Clone()}
		l.mu.Unlock()
	}
	epoch, err := l.post(ctx, agentapi.PathPulls, p)
	if !notify {
		return err
	}
	if err != nil {
		l.failPull(p.Request, err)
		return err
	}
	l.mu.Lock()
	if t, ok := l.pulls[p.Request]; ok { // not reported yet
		t.epoch = epoch
		l.pulls[p.Request] = t
	}
	l.mu.Unlock()
	return nil
}

// Expect announces a prefill request that will hold blocks for consumers.
func (l *Link) Expect(ctx context.Context, transfer kvtransfer.TransferID, req kvtransfer.RequestID) error {
	_, err := l.post(ctx, agentapi.PathExpect, agentapi.Hold{Transfer: transfer, Request: req})
	return err
}

// Ready hands held blocks to the agent. Blocks the agent did not take are released at once.
func (l *Link) Ready(ctx context.Context, transfer kvtransfer.TransferID, req kvtransfer.RequestID, blocks kvtransfer.BlockIDs) error {
	holds := blocks.HasLocal()
	if holds {
		l.mu.Lock()
		l.held[transfer] = trackedHold{epoch: "?", request: req, blocks: blocks.Count()}
		l.mu.Unlock()
	}
	epoch, err := l.post(ctx, agentapi.PathReady, agentapi.Hold{Transfer: transfer, Request: req, Blocks: blocks})
	if !holds {
		return err
	}
	if err != nil {
		l.releaseHold(transfer, kvtransfer.ReleaseAborted)
		return err
	}
	l.mu.Lock()
	if h, ok := l.held[transfer]; ok {
		h.epoch = epoch
		l.held[transfer] = h
	}
	l.mu.Unlock()
	return nil
}

// Abort tells the agent a prefill request will not be ready.
func (l *Link) Abort(ctx context.Context, transfer kvtransfer.TransferID) error {
	_, err := l.post(ctx, agentapi.PathAbort, agentapi.Hold{Transfer: transfer})
	return err
}

func (l *Link) failPull(req kvtransfer.RequestID, cause error) {
	l.mu.Lock()
	t, ok := l.pulls[req]
	delete(l.pulls, req)
	if ok {
		l.lost[req] = struct{}{}
	}
	l.mu.Unlock()
	if ok {
		l.completions.FinishedReceiving(lostCompletion(req, t.blocks, cause))
	}
}

func lostCompletion(req kvtransfer.RequestID, blocks kvtransfer.BlockIDs, cause error) kvtransfer.Completion {
	c := kvtransfer.Completion{Request: req, Err: fmt.Errorf("%w: %v", ErrAgentLost, cause)}
	if len(blocks) > 1 {
		c.FailedRequest = true
	} else {
		c.InvalidBlocks = blocks.Flatten()
	}
	return c
}

func (l *Link) releaseHold(transfer kvtransfer.TransferID, reason kvtransfer.ReleaseReason) {
	l.mu.Lock()
	h, ok := l.held[transfer]
	delete(l.held, transfer)
	l.mu.Unlock()
	if ok {
		l.releases.FinishedSending(kvtransfer.Release{Request: h.request, Transfer: transfer, Blocks: h.blocks, Reason: reason})
	}
}

// Run polls the agent's reports until ctx ends.
func (l *Link) Run(ctx context.Context) {
	lastOK := time.Now()
	for ctx.Err() == nil {
		ev, err := l.poll(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if time.Since(lastOK) > l.LostAfter {
				l.forget("", fmt.Errorf("unreachable for %v: %v", l.LostAfter, err))
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		lastOK = time.Now()
		l.deliver(ev)
	}
}

func (l *Link) poll(ctx context.Context) (agentapi.Events, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, l.base+agentapi.PathEvents+"?wait_ms=1000", nil)
	if err != nil {
		return agentapi.Events{}, err
	}
	resp, err := l.hc.Do(req)
	if err != nil {
		return agentapi.Events{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return agentapi.Events{}, fmt.Errorf("agent events: %s", resp.Status)
	}
	var ev agentapi.Events
	return ev, json.NewDecoder(resp.Body).Decode(&ev)
}

// deliver passes reports on, once each: a report for a request the Link does not track (it
// was already failed because the agent was lost) is dropped.
func (l *Link) deliver(ev agentapi.Events) {
	l.mu.Lock()
	// Any other run than the one last heard from (or none heard from yet: the first answer can
	// come from a restarted agent) leaves the state of the runs before it orphaned.
	changed := l.epoch != ev.Epoch
	if changed {
		clear(l.lost) // a new agent run never reports the old one's pulls
	}
	l.epoch = ev.Epoch
	l.mu.Unlock()
	if changed {
		l.forget(ev.Epoch, errors.New("agent restarted"))
	}
	for _, c := range ev.Completions {
		l.mu.Lock()
		_, ok := l.pulls[c.Request]
		delete(l.pulls, c.Request)
		_, lost := l.lost[c.Request]
		delete(l.lost, c.Request)
		l.mu.Unlock()
		if lost {
			continue // already failed by the Link
		}
		if !ok {
			// A report for a pull that never notifies the scheduler: only an ungated agent
			// sends one. It is passed on, not hidden: the scheduler's assertion is the
			// evidence of that bug.
			l.completions.FinishedReceiving(kvtransfer.Completion{Request: c.Request})
			continue
		}
		var err error
		if c.Error != "" {
			err = errors.New(c.Error)
		}
		l.completions.FinishedReceiving(kvtransfer.Completion{Request: c.Request, Err: err, InvalidBlocks: c.InvalidBlocks, FailedRequest: c.FailedRequest})
	}
	for _, r := range ev.Releases {
		l.releaseHold(r.Transfer, kvtransfer.ReleaseReason(r.Reason))
	}
}

// forget fails every pull and releases every hold the agent held that is not from epoch
// keep: the agent that had them is gone.
func (l *Link) forget(keep string, cause error) {
	l.mu.Lock()
	var pulls []kvtransfer.Completion
	for req, t := range l.pulls {
		if keep == "" || (t.epoch != keep && t.epoch != "?") {
			pulls = append(pulls, lostCompletion(req, t.blocks, cause))
			delete(l.pulls, req)
			l.lost[req] = struct{}{} // whatever claims to report it later is not believed
		}
	}
	var holds []kvtransfer.TransferID
	for id, h := range l.held {
		if keep == "" || (h.epoch != keep && h.epoch != "?") {
			holds = append(holds, id)
		}
	}
	if keep == "" {
		l.epoch = ""
	}
	l.mu.Unlock()
	if len(pulls) > 0 || len(holds) > 0 {
		l.Log.Info("connector agent lost its state", "cause", cause.Error(), "pulls", len(pulls), "holds", len(holds))
	}
	for _, c := range pulls {
		l.completions.FinishedReceiving(c)
	}
	for _, id := range holds {
		l.releaseHold(id, releaseAgentLost)
	}
}

// Outstanding is the number of pulls awaiting a report and transfers held, for tests and
// metrics.
func (l *Link) Outstanding() (pulls, holds int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.pulls), len(l.held)
}
