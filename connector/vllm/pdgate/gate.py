"""The completion gate, apart from vLLM: which pulls the scheduler may hear of.

A pull with no local destination block in any KV-cache group only tells the producer to free
its blocks. vLLM's stock connectors report such a pull in ``finished_recving`` (Mooncake) or,
when it fails, in the failure path (Mooncake, NIXL); the scheduler then asserts on a request
that is not waiting for remote KV and the engine dies. The gate remembers those pulls when the
scheduler builds the connector metadata and strips them from the connector output before the
scheduler's loops see it. Producer notification, and every pull with a local block, are left to
vLLM exactly as it does them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

# vLLM's logger tree, as in _vllm.py: its handler is the engine's log.
logger = logging.getLogger("vllm.pdgate")

# A record's deadline: after vLLM's abort timeout (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s)
# and the consumer's receive timeout (+60 s), with a margin, the pull has completed or failed.
DEFAULT_TTL_SECONDS = 480.0 + 60.0 + 120.0
# The deadline bounds when a pull completes, not when its report reaches the scheduler: an idle
# engine does not step (EngineCore blocks on its input queue while it has no request), so a
# completion waits in the worker until the next request's step, however late. A record past its
# deadline is therefore kept until this many scheduler steps later, which covers the steps a
# report lags behind the schedule that produced it (async scheduling: one; pipeline
# parallelism: one per stage in the batch queue).
DEFAULT_GRACE_STEPS = 64


def has_local_block(local_block_ids: Any) -> bool:
    """Whether a pull has at least one local destination block.

    ``local_block_ids`` is ``list[list[int]]`` (one list per KV-cache group, vLLM >= 2026-04)
    or ``list[int]`` (older). It is length-based: block 0 is a block (``any([0])`` is False).
    """
    if not local_block_ids:
        return False
    for group in local_block_ids:
        if isinstance(group, (list, tuple)):
            if len(group) > 0:
                return True
        else:
            return True  # a flat list with an element
    return False


class Counts:
    """What the gate did, for the sidecar's metrics. Only ever incremented."""

    def __init__(self) -> None:
        self.gated = 0  # finished_recving reports suppressed (empty pulls)
        self.passed = 0  # finished_recving reports passed (pulls with local blocks)
        self.failed = 0  # failed_recving reports of pulls with local blocks seen
        self.expired = 0  # records dropped without a report (past the deadline and the grace steps)
        self.send_failures = 0  # reports to the sidecar dropped

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class HeldSends:
    """A producer's requests whose blocks vLLM holds for a consumer's pull not made yet: a
    request_finished that delayed the free, until the step's finished_sending names it (a
    pull, or vLLM's abort timeout). What a drain waits for, and why a busy prefill pod must
    not be the one a scale-down deletes.

    The scheduler's loop adds and removes; the reporter thread only reads ``len``. An entry
    the engine never reports goes after ``ttl_seconds`` (past vLLM's abort timeout), so the
    count cannot stay above 0 for a report that was lost.
    """

    def __init__(self, ttl_seconds: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl_seconds
        self._clock = clock
        self._held: dict[str, float] = {}  # request id -> deadline, oldest first
        self.count = 0  # len(self._held), as the reporter thread reads it

    def finished(self, req_id: str, delay_free: bool) -> None:
        """request_finished's answer: delay_free means the blocks wait for a pull."""
        self._held.pop(req_id, None)
        if delay_free:
            self._held[req_id] = self._clock() + self._ttl
        self._expire()

    def sent(self, finished_sending: Optional[Iterable[str]]) -> None:
        """A step's finished_sending: those blocks are free."""
        for req_id in finished_sending or ():
            self._held.pop(req_id, None)
        self._expire()

    def _expire(self) -> None:
        now = self._clock()
        while self._held:
            req_id, deadline = next(iter(self._held.items()))
            if deadline > now:
                break
            del self._held[req_id]
        self.count = len(self._held)

    def __len__(self) -> int:
        return self.count


class Gate:
    """Remembers empty pulls and strips them from the connector output. Not thread-safe by
    itself: vLLM's scheduler calls both hooks from its one loop.

    A record goes when its report passes the gate, or when no report can come any more: past
    its deadline (wall clock) and then ``grace_steps`` scheduler steps (``observe`` calls)
    later. Time alone never drops one, so an engine idle for any length of time still gates
    the report its next step delivers. Memory stays bounded by the empty pulls of one TTL:
    a record is made only in a step, and every step moves the clock of the oldest ones on.
    """

    def __init__(self, ttl_seconds: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 grace_steps: int = DEFAULT_GRACE_STEPS) -> None:
        self._ttl = ttl_seconds
        self._clock = clock
        self._grace = grace_steps
        self._step = 0
        # request id -> deadline, oldest first (a monotonic clock and a fixed TTL keep
        # insertion order deadline order; a re-recorded id is removed and added again).
        self._pending: dict[str, float] = {}
        # request id -> the step at which its deadline was seen passed, oldest first.
        self._overdue: dict[str, int] = {}
        self.counts = Counts()

    def __len__(self) -> int:
        return len(self._pending) + len(self._overdue)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pending or req_id in self._overdue

    def _forget(self, req_id: str) -> bool:
        """Drops the record of req_id; returns whether there was one."""
        found = req_id in self
        self._pending.pop(req_id, None)
        self._overdue.pop(req_id, None)
        return found

    def observe(self, pulls: Iterable[tuple[str, Any]]) -> None:
        """Classifies the pulls of one metadata build (one scheduler step): (request id,
        local_block_ids) pairs."""
        self._step += 1
        now = self._clock()
        for req_id, local_block_ids in pulls:
            # A request may be pulled again (preemption, retry): the newest pull decides.
            self._forget(req_id)
            if not has_local_block(local_block_ids):
                self._pending[req_id] = now + self._ttl
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._pending:
            req_id, deadline = next(iter(self._pending.items()))
            if deadline > now:
                break
            del self._pending[req_id]
            self._overdue[req_id] = self._step
        while self._overdue:
            req_id, since = next(iter(self._overdue.items()))
            if self._step - since < self._grace:
                break
            del self._overdue[req_id]
            self.counts.expired += 1

    def filter_finished(self, finished: Optional[set]) -> Optional[set]:
        """Returns finished_recving without the empty pulls (None when nothing is left)."""
        if not finished:
            return finished
        kept = set()
        for req_id in finished:
            if self._forget(req_id):  # every worker's report is aggregated into this one
                self.counts.gated += 1
            else:
                kept.add(req_id)
                self.counts.passed += 1
        return kept or None

    def filter_failed(self, failed: Any) -> Any:
        """Returns failed_recving (a set, or a dict of request id to failure) without the empty
        pulls, in the same shape. Where vLLM has the field its scheduler has already read it
        (update_from_output, before update_connector_output) and skips ids it does not wait
        for, so this keeps the output consistent but prevents nothing and is not counted as
        gated. The record stays for the finished_recving report of the same pull."""
        if not failed:
            return failed
        kept = [r for r in failed if r not in self]
        self.counts.failed += len(kept)
        if isinstance(failed, Mapping):
            return type(failed)({r: failed[r] for r in kept})
        return type(failed)(kept)

    def filter_output(self, output: Any) -> None:
        """Strips empty pulls from a KVConnectorOutput in place. Failures go first: a failed
        empty pull may be reported in both fields, and the record is dropped with the
        finished_recving report."""
        if output is None:
            return
        if getattr(output, "failed_recving", None):
            output.failed_recving = self.filter_failed(output.failed_recving)
        if getattr(output, "finished_recving", None):
            output.finished_recving = self.filter_finished(output.finished_recving)


class Reporter:
    """Sends the gate's counts to the connector sidecar as a heartbeat, over the pod-local Unix
    socket, from a daemon thread. The engine never waits for it: a send that fails is dropped
    and counted, and the next heartbeat carries the totals."""

    def __init__(self, socket_path: str, counts: Counts, connector: str, vllm_version: str,
                 role: str, interval_seconds: float = 5.0, timeout_seconds: float = 1.0,
                 held: Optional[HeldSends] = None, dp_rank: int = 0) -> None:
        self._path = socket_path
        self._counts = counts
        self._held = held
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._static = {"connector": connector, "vllm_version": vllm_version, "role": role,
                        "pid": os.getpid(), "plugin_version": _plugin_version(),
                        # vLLM runs one scheduler, so one gate, per data-parallel rank: the
                        # sidecar keeps one record per rank.
                        "dp_rank": dp_rank}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdgate-reporter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.send_once()
            self._stop.wait(self._interval)

    def payload(self) -> bytes:
        body: dict[str, Any] = dict(self._static)
        body["counts"] = self._counts.as_dict()
        if self._held is not None:
            body["held_sends"] = len(self._held)
        return json.dumps(body).encode()

    def send_once(self) -> bool:
        """One heartbeat: POST /v1/gate on the sidecar's local API. Returns whether it landed."""
        body = self.payload()
        request = (b"POST /v1/gate HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self._timeout)
                s.connect(self._path)
                s.sendall(request)
                status = s.recv(64).split(b" ", 2)
            if len(status) < 2 or not status[1].startswith(b"2"):
                raise OSError("sidecar answered %r" % (b" ".join(status),))
            return True
        except OSError as e:
            self._counts.send_failures += 1
            logger.debug("pdgate: heartbeat to %s dropped: %s", self._path, e)
            return False


def _plugin_version() -> str:
    from . import __version__
    return __version__


TTL_ENV = "PDGATE_TTL_SECONDS"


def ttl_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """The gate's TTL: PDGATE_TTL_SECONDS, else DEFAULT_TTL_SECONDS. A record never goes on time
    alone, so a short TTL (tests) only lets records go sooner once grace steps have passed."""
    raw = environ.get(TTL_ENV, "")
    if not raw:
        return DEFAULT_TTL_SECONDS
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not ttl > 0:
        raise ValueError(f"pdgate: {TTL_ENV}={raw!r}: want a positive number of seconds")
    return ttl


def socket_path_from_env(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The sidecar's local API socket, from PDCLUSTER_CONNECTOR_URL (unix:///path)."""
    url = environ.get("PDCLUSTER_CONNECTOR_URL", "")
    if url.startswith("unix://"):
        return url[len("unix://"):]
    return None
