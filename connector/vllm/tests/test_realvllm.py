"""The gate against the installed vLLM release (make test-plugin installs each tested release
into a virtual environment of its own and runs this suite on it). Never skipped: without vLLM
these tests fail, because a gate nobody ran against vLLM is not tested.

Every empty-pull scenario runs twice, through vLLM's stock class and through the gated one,
on the same real Scheduler. On a release whose Mooncake worker still reports empty pulls
(STOCK_REPORTS_EMPTY_PULLS) the stock class must kill the scheduler with its assertion, which
proves the scenario reaches the bug; the gated class must never.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
import unittest
from typing import Any, Callable, Optional

from tests import realvllm as rv

import vllm  # no skip: an environment without vLLM fails here
from vllm.v1.request import RequestStatus

VERSION = vllm.__version__
# Releases whose MooncakeConnectorWorker adds every settled pull to finished_recving, local
# blocks or not (the seed bug). vLLM 0.32.0 added `and any(pull_meta.local_block_ids)`.
STOCK_REPORTS_EMPTY_PULLS = {"0.30.0": True, "0.32.0": False, "0.33.0": False}


# Releases whose scheduler gives a full-attention request no external tokens when it skips
# the prefix cache (prompt logprobs); on the others only hybrid (Mamba) models get there.
NO_EXTERNAL_TOKENS_ON_FULL_ATTENTION = {"0.30.0": False, "0.32.0": True, "0.33.0": True}


def measured(table: dict[str, bool]) -> bool:
    if VERSION not in table:
        raise AssertionError(f"vLLM {VERSION} is not measured in this table: measure it and add it")
    return table[VERSION]


def stock_dies() -> bool:
    return measured(STOCK_REPORTS_EMPTY_PULLS)


class Unreachable(Exception):
    """The scenario cannot be reached on this release (see the tables above)."""


def scheduler_assert(fn: Callable[..., Any], *args: Any) -> Optional[str]:
    """Runs fn and returns where vLLM's scheduler asserted (None if it did not). An assertion
    raised anywhere else (the test's own) is raised again."""
    try:
        fn(*args)
    except AssertionError as e:
        frames = traceback.extract_tb(e.__traceback__)
        if frames and frames[-1].filename.replace("\\", "/").endswith("vllm/v1/core/sched/scheduler.py"):
            return f"{frames[-1].name}: {frames[-1].line}"
        raise
    return None


MOONCAKE = rv.rendered_kv_transfer_configs("minimal.golden.yaml")
NIXL = rv.rendered_kv_transfer_configs("nixl-tcp.golden.yaml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(gated: bool, tp: int = 1, groups: int = 1) -> rv.Engine:
    raw = MOONCAKE["kv_consumer"]
    e = rv.Engine(raw if gated else rv.stock(raw), tp=tp, groups=groups)
    assert type(e.connector).__name__ == ("GatedMooncakeConnector" if gated else "MooncakeConnector")
    return e


def cleanup_pull(e: rv.Engine, rejected: bool = False) -> Any:
    """A request aborted before its first schedule: freed at once, request_finished queues the
    cleanup pull, and the step that has the finished request carries it. rejected is
    AsyncLLM.notify_kv_transfer_request_rejected's request (abort_immediately)."""
    r = e.request()
    r.abort_immediately = rejected
    e.abort(r)
    e.step()
    return r


# Each scenario drives a decode engine to the point where the pull's report is due, delivers
# it and steps on; it returns the request. An engine that dies raises AssertionError.
def abort_before_first_schedule(e: rv.Engine) -> Any:
    r = cleanup_pull(e)
    e.answer(r)
    e.step()
    return r


def rejected_request(e: rv.Engine) -> Any:
    r = cleanup_pull(e, rejected=True)
    e.answer(r)
    e.step()
    return r


def no_external_tokens(e: rv.Engine) -> Any:
    # A request that loads nothing although prefill ran (here prompt logprobs, which skip
    # reading any prefix cache; on hybrid models a full local hit): update_state_after_alloc
    # gets num_external_tokens == 0 and the pull only frees prefill's blocks. The request runs.
    r = e.request(prompt_logprobs=True)
    e.step()
    if e.status(r) != RequestStatus.RUNNING:
        raise Unreachable(f"the request is {e.status(r).name}: it loads external tokens")
    e.answer(r)
    e.step()
    return r


def failed_empty_pull(e: rv.Engine) -> Any:
    r = cleanup_pull(e)
    e.answer(r, ok=False)
    e.step()
    return r


def idle_engine(e: rv.Engine, clock: Clock) -> Any:
    # The cleanup pull's answer comes after the step that started it; the worker holds the
    # completion, and with no request left EngineCore does not step. The next request comes
    # long after the gate's deadline: its step delivers the held report.
    e.answer(cleanup_pull(e))
    clock.now += 3600  # a quiet hour
    nxt = e.request()
    e.step()  # its first step: build_connector_meta, then the held report
    e.step()
    return nxt


def lagging_report(e: rv.Engine, lag: int, clock: Clock) -> Any:
    # Async scheduling and pipeline parallelism: the scheduler schedules `lag` more steps
    # before the output carrying the report is processed; the deadline passed while idle.
    e.answer(cleanup_pull(e))
    clock.now += 3600
    nxt = e.request()
    first = e.schedule()
    e.execute(first)  # the report is in this step's output...
    for _ in range(lag):  # ...which is processed after `lag` more schedules
        e.execute(e.schedule())
    for _ in range(lag + 1):
        e.process()
    return nxt


EMPTY_PULLS: dict[str, Callable[[rv.Engine], Any]] = {
    "abort before first schedule": abort_before_first_schedule,
    "rejected request": rejected_request,
    "no external tokens": no_external_tokens,
}


class EmptyPullsTest(unittest.TestCase):
    def run_both(self, scenario: Callable[..., Any], *args: Any, tp: int = 1) -> rv.Engine:
        if stock_dies():
            died = scheduler_assert(scenario, engine(gated=False, tp=tp), *args)
            self.assertIsNotNone(died, "the stock class survived: the scenario does not reach the bug")
        else:
            scenario(engine(gated=False, tp=tp), *args)  # upstream gates the success path itself
        e = engine(gated=True, tp=tp)
        for a in args:
            if isinstance(a, Clock):
                e.gate._clock = a
        scenario(e, *args)
        return e

    def test_empty_pulls(self) -> None:
        for name, scenario in EMPTY_PULLS.items():
            with self.subTest(name):
                if scenario is no_external_tokens and not measured(NO_EXTERNAL_TOKENS_ON_FULL_ATTENTION):
                    with self.assertRaises(Unreachable):
                        scenario(engine(gated=True))
                    continue
                e = self.run_both(scenario)
                self.assertEqual(e.gate.counts.gated, 1 if stock_dies() else 0)
                self.assertEqual(e.gate.counts.passed, 0)

    def test_failed_empty_pull(self) -> None:
        # Every tested release's _handle_failed_recv skips a pull without local blocks: the
        # failure path is quiet under both classes, and the gate counts nothing.
        for gated in (False, True):
            e = engine(gated)
            failed_empty_pull(e)
            if gated:
                self.assertEqual((e.gate.counts.gated, e.gate.counts.failed), (0, 0))

    def test_idle_engine_past_the_deadline(self) -> None:
        e = self.run_both(idle_engine, Clock())
        self.assertEqual(e.gate.counts.gated, 1 if stock_dies() else 0)
        self.assertEqual(e.gate.counts.expired, 0)

    def test_report_lagging_steps(self) -> None:
        for lag in (1, 2):
            with self.subTest(lag=lag):
                self.run_both(lagging_report, lag, Clock())

    def test_tp_fan_out(self) -> None:
        # Four decode workers each report the empty pull; the aggregator passes it once.
        e = self.run_both(abort_before_first_schedule, tp=4)
        self.assertEqual(e.gate.counts.gated, 1 if stock_dies() else 0)
        self.assertEqual(len(e.gate), 0 if stock_dies() else 1)

    def test_record_goes_only_after_deadline_and_grace_steps(self) -> None:
        # On a release that never reports the pull, the record must still go, and only then.
        e = engine(gated=True)
        clock = Clock()
        e.gate._clock = clock
        r = cleanup_pull(e)
        self.assertIn(r.request_id, e.gate)
        clock.now += 3600
        for _ in range(e.gate._grace - 1):
            e.step()
        self.assertIn(r.request_id, e.gate, "dropped before the grace steps")
        e.step()
        e.step()
        self.assertNotIn(r.request_id, e.gate)


class PullsWithBlocksTest(unittest.TestCase):
    """Pulls with a local block complete exactly as vLLM completes them, under both classes."""

    def test_normal_pull(self) -> None:
        for gated in (False, True):
            with self.subTest(gated=gated):
                e = engine(gated, tp=2)
                r = e.request()
                e.step()
                self.assertEqual(e.status(r), RequestStatus.WAITING_FOR_REMOTE_KVS)
                e.answer(r)
                e.step()  # the report
                e.step()  # the request resumes
                self.assertEqual(e.status(r), RequestStatus.RUNNING)
                if gated:
                    self.assertEqual((e.gate.counts.passed, e.gate.counts.gated), (1, 0))

    def test_abort_while_waiting_is_freed_by_the_late_report(self) -> None:
        for gated in (False, True):
            with self.subTest(gated=gated):
                e = engine(gated)
                r = e.request()
                e.step()
                e.abort(r)  # delayed free: blocks held until the report
                self.assertIn(r.request_id, e.scheduler.requests)
                e.answer(r)
                e.step()
                self.assertNotIn(r.request_id, e.scheduler.requests, "the aborted request was left behind")

    def test_failed_pull_with_blocks_reaches_the_scheduler(self) -> None:
        e = engine(gated=True)
        r = e.request()
        e.step()
        e.answer(r, ok=False)
        e.step()
        e.step()
        # kv_load_failure_policy "fail" (as rendered): the request ends with an error.
        self.assertNotIn(r.request_id, e.scheduler.requests)
        self.assertEqual(e.gate.counts.gated, 0)


class NixlTest(unittest.TestCase):
    """NIXL's worker cannot run here (no nixl package); its failure path hands the scheduler
    a finished_recving for a failed pull, which for an empty pull would kill it. The report is
    delivered here as that path delivers it, to the real scheduler and connector."""

    def test_empty_pull_report_is_gated(self) -> None:
        for gated in (False, True):
            with self.subTest(gated=gated):
                raw = NIXL["kv_consumer"]
                e = rv.Engine(raw if gated else rv.stock(raw))
                r = e.request(kv_transfer_params={
                    "do_remote_prefill": True, "remote_engine_id": rv.ENGINE, "remote_request_id": "p-1",
                    "remote_block_ids": [[1, 2]], "remote_host": "prefill", "remote_port": 5600, "tp_size": 1})
                e.abort(r)
                e.step()
                from vllm.v1.outputs import KVConnectorOutput
                e.in_flight.append((e.schedule(), [KVConnectorOutput(finished_recving={r.request_id})]))
                if gated:
                    e.process()
                    self.assertEqual(e.gate.counts.gated, 1)
                else:
                    self.assertIsNotNone(scheduler_assert(e.process))


class HeldSendsTest(unittest.TestCase):
    """On a prefill (kv_producer) engine the gate counts the requests whose blocks vLLM holds
    for decode's pull: what vLLM's own drain (--shutdown-timeout) waits for, and what the
    operator's pod-deletion-cost and the sidecar's preStop read. The count follows the real
    scheduler's own: a finished request kept in scheduler.requests until finished_sending."""

    def held_by_vllm(self, e: rv.Engine) -> int:
        s = e.scheduler
        return len([r for r in s.requests.values() if r.is_finished()])

    def test_held_until_the_pull_and_counted_as_vllm_holds_them(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        for flow, configs, params in (
                ("mooncake", MOONCAKE, lambda i: {"do_remote_decode": True, "transfer_id": f"xfer-{i}"}),
                ("nixl", NIXL, lambda i: {"do_remote_decode": True})):
            with self.subTest(flow):
                e = rv.Engine(configs["kv_producer"])
                reqs = [e.request(max_tokens=1, kv_transfer_params=params(i)) for i in range(3)]
                local = e.request(max_tokens=1, remote=False)  # not for decode: freed at once
                for _ in range(4):
                    e.step()
                for r in reqs + [local]:
                    self.assertTrue(e.status(r) is None or e.status(r).name.startswith("FINISHED"), e.status(r))
                self.assertEqual(self.held_by_vllm(e), 3, "vLLM does not hold the blocks of requests for decode")
                self.assertEqual(len(e.connector._pdgate_held), 3)
                self.assertTrue(e.scheduler.has_requests(), "vLLM's drain would not wait for these")
                # Decode pulled the first two: the worker reports finished_sending.
                e.in_flight.append((e.schedule(), [KVConnectorOutput(finished_sending={reqs[0].request_id, reqs[1].request_id})]))
                e.process()
                self.assertEqual((self.held_by_vllm(e), len(e.connector._pdgate_held)), (1, 1))
                e.in_flight.append((e.schedule(), [KVConnectorOutput(finished_sending={reqs[2].request_id})]))
                e.process()
                self.assertEqual((self.held_by_vllm(e), len(e.connector._pdgate_held)), (0, 0))


class DataParallelTest(unittest.TestCase):
    """vLLM runs one EngineCore, and so one scheduler and one gate, per data-parallel rank; the
    sidecar keeps one record per rank and needs each gate to say which it is."""

    def test_the_heartbeat_names_the_engines_rank_on_its_pod(self) -> None:
        os.environ["PDCLUSTER_CONNECTOR_URL"] = "unix:///nonexistent/agent.sock"
        try:
            for dp, want in (((1, 0, 0), 0), ((4, 3, 3), 3), ((8, 6, 2), 2)):  # the last: hybrid LB, node 2 of 2
                with self.subTest(dp=dp):
                    e = rv.Engine(MOONCAKE["kv_consumer"], dp=dp)
                    reporter = e.connector._pdgate_reporter
                    self.assertIsNotNone(reporter, "the scheduler's gate does not report")
                    reporter.stop()
                    self.assertEqual(json.loads(reporter.payload())["dp_rank"], want)
        finally:
            del os.environ["PDCLUSTER_CONNECTOR_URL"]


class LoadLineTest(unittest.TestCase):
    """The engine's log says the gate loaded: vLLM puts its handler on its own "vllm" logger
    (at import up to 0.30, when each engine process starts from 0.32 on), so a plugin logger
    outside that tree printed nothing, though docs/completion-gate.md promised the line. The
    line in a running engine's log: test/realengine."""

    def test_the_load_line_goes_to_vllms_logger(self) -> None:
        with self.assertLogs("vllm", level="INFO") as logs:
            rv.Engine(MOONCAKE["kv_consumer"])
        line = f"pdgate: GatedMooncakeConnector loaded on vLLM {VERSION} (role SCHEDULER)"
        self.assertTrue(any(line in out for out in logs.output), f"{line!r} not in {logs.output}")


class ContractTest(unittest.TestCase):
    """vLLM's own factory loads the gated classes from the exact kv_transfer_config JSON the
    operator renders (read from the render golden files), for both roles and connectors."""

    def test_factory_loads_the_rendered_configs(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        for flow, configs, want in (("mooncake", MOONCAKE, "GatedMooncakeConnector"),
                                    ("nixl", NIXL, "GatedNixlConnector")):
            for role in ("kv_producer", "kv_consumer"):
                with self.subTest(flow=flow, role=role):
                    kv = rv.parse_kv_transfer_config(configs[role])
                    cls = KVConnectorFactory.get_connector_class(kv)
                    self.assertEqual(cls.__name__, want)
                    self.assertEqual(cls.__module__, f"pdgate.{flow}")
                    e = rv.Engine(configs[role])
                    self.assertIs(type(e.connector), cls)
                    self.assertIsNotNone(e.gate, "the connector the scheduler built is not gated")

    def test_vllms_parser_takes_the_rendered_engine_commands(self) -> None:
        # vLLM's own `vllm serve` parser, as its CLI builds it, reads every rendered command
        # line: a flag vLLM does not define, or a value it refuses, exits 2 as in a pod.
        import yaml

        parser = rv.serve_parser()
        commands = 0
        for golden in sorted(rv.GOLDEN.glob("*.golden.yaml")):
            for doc in yaml.safe_load_all(golden.read_text()):
                if not doc or doc.get("kind") != "Deployment":
                    continue
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if c.get("command") != ["vllm"]:
                        continue
                    args = list(c["args"])
                    self.assertEqual(args[0], "serve")
                    with self.subTest(golden=golden.name, deployment=doc["metadata"]["name"]):
                        commands += 1
                        try:
                            ns = parser.parse_args(args[1:])
                        except SystemExit as e:
                            self.fail(f"vLLM {VERSION} refuses {args}: exit {e.code}")
                        i = args.index("--shutdown-timeout")
                        self.assertEqual(ns.shutdown_timeout, int(args[i + 1]))
        self.assertGreater(commands, 10)
        with self.assertRaises(SystemExit):
            parser.parse_args(["m", "--no-such-flag"])

    def test_vllms_parser_takes_the_launched_multinode_commands(self) -> None:
        # Each pod's command line as `connector launch` completes it, read by vLLM's own
        # parser: the flags exist and carry this pod's rank.
        import json

        parser = rv.serve_parser()
        commands = json.loads(rv.LAUNCHED.read_text())
        self.assertEqual(len(commands), 4)
        for c in commands:
            with self.subTest(pod=c["name"]):
                try:
                    ns = parser.parse_args(c["args"][1:])
                except SystemExit as e:
                    self.fail(f"vLLM {VERSION} refuses {c['args']}: exit {e.code}")
                index = int(c["name"].rsplit("-", 1)[1])
                if "--data-parallel-hybrid-lb" in c["args"]:
                    self.assertTrue(ns.data_parallel_hybrid_lb)
                    self.assertEqual(ns.data_parallel_size_local, 8)
                    self.assertEqual(ns.data_parallel_start_rank, 8 * index)
                    self.assertEqual(ns.data_parallel_address, "10.0.0.9")
                    self.assertFalse(ns.headless)
                else:
                    self.assertEqual((ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port), (2, index, "10.0.0.9", 29501))
                    self.assertEqual(ns.headless, index > 0)
                    self.assertEqual(ns.distributed_executor_backend, "mp")

    def test_vllms_parser_takes_the_rendered_groups_pods(self) -> None:
        # Every pod of render's LeaderWorkerSets, its command completed by the connector
        # binary's own `launch` (cmd/connector): vLLM's parser takes it, with this pod's rank,
        # and the rendered --kv-transfer-config.
        import json

        parser = rv.serve_parser()
        pods = json.loads(rv.LAUNCHED_RENDERED.read_text())
        self.assertGreaterEqual(len(pods), 6)
        for p in pods:
            with self.subTest(pod=p["name"]):
                try:
                    ns = parser.parse_args(p["args"][1:])
                except SystemExit as e:
                    self.fail(f"vLLM {VERSION} refuses {p['args']}: exit {e.code}")
                index = int(p["name"].rsplit("/", 1)[1])
                role = "kv_producer" if "-prefill-" in p["name"] else "kv_consumer"
                self.assertEqual(ns.kv_transfer_config.kv_role, role)
                self.assertTrue(ns.kv_transfer_config.kv_connector.startswith("Gated"))
                if ns.data_parallel_hybrid_lb:
                    self.assertEqual(ns.data_parallel_start_rank, ns.data_parallel_size_local * index)
                    self.assertEqual(ns.data_parallel_size % ns.data_parallel_size_local, 0)
                    self.assertFalse(ns.headless)
                else:
                    self.assertEqual(ns.node_rank, index)
                    self.assertEqual(ns.headless, index > 0)
                    self.assertEqual(ns.distributed_executor_backend, "mp")
                    self.assertEqual(ns.tensor_parallel_size * ns.pipeline_parallel_size % ns.nnodes, 0)
                self.assertIn(f"VLLM_HOST_IP=10.0.0.{10 + index}", p["env"])

    def test_stock_name_with_the_plugin_module_fails_loudly(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        import json

        for flow, configs, stock_name in (("mooncake", MOONCAKE, "MooncakeConnector"),
                                          ("nixl", NIXL, "NixlConnector")):
            with self.subTest(flow):
                cfg = json.loads(configs["kv_consumer"])
                cfg["kv_connector"] = stock_name
                kv = rv.parse_kv_transfer_config(json.dumps(cfg))
                with self.assertRaises(AttributeError) as ctx:
                    KVConnectorFactory.get_connector_class(kv)
                self.assertIn("Gated" + stock_name, str(ctx.exception.__cause__ or ctx.exception))


class RefusalTest(unittest.TestCase):
    """An unsupported vLLM is refused at import: the real release with one surface taken away,
    as a later release might."""

    def reimport(self, module: str) -> Any:
        for name in ("pdgate.mooncake", "pdgate.nixl", "pdgate._vllm"):
            sys.modules.pop(name, None)
        return importlib.import_module(module)

    def tearDown(self) -> None:
        self.reimport("pdgate.mooncake")
        self.reimport("pdgate.nixl")

    def test_missing_surface(self) -> None:
        mc = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
        nixl_meta = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")

        def nested_once_more(meta_cls: type) -> Callable[[], None]:
            add = meta_cls.add_new_req

            def changed(self: Any, request_id: str, *a: Any, **kw: Any) -> None:
                add(self, request_id, *a, **kw)  # a later vLLM nesting by (engine, dp rank)
                self.reqs_to_recv = {k: {0: v} for k, v in self.reqs_to_recv.items()}
            return changed

        cases = [
            ("pdgate.mooncake", mc.MooncakeConnectorMetadata, "add_new_req", nested_once_more(mc.MooncakeConnectorMetadata), "shape"),
            ("pdgate.mooncake", mc, "PullReqMeta", None, "PullReqMeta"),
            ("pdgate.nixl", nixl_meta.NixlConnectorMetadata, "add_new_req_to_recv", None, "shape"),
        ]
        for module, owner, attr, replacement, what in cases:
            with self.subTest(module=module, attr=attr):
                saved = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
                try:
                    if replacement is None:
                        delattr(owner, attr)
                    else:
                        setattr(owner, attr, replacement)
                    with self.assertRaises(ImportError) as ctx:
                        self.reimport(module)
                    self.assertIn(f"vLLM {VERSION}", str(ctx.exception))
                    self.assertIn(what, str(ctx.exception))
                    self.assertIn("completionGate: Disabled", str(ctx.exception))
                finally:
                    setattr(owner, attr, saved)

    def test_changed_shape_the_walk_survives(self) -> None:
        # The walk of the probe's metadata completes without raising, but does not find the
        # probe's one empty pull as it put it in: the gate would see no pull (or a wrong one)
        # and the engine would run ungated in effect. Only the comparison can refuse these.
        mc = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
        nixl_meta = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")
        MC, NIXL_META = mc.MooncakeConnectorMetadata, nixl_meta.NixlConnectorMetadata
        PROBE = "pdgate-import-probe"  # pdgate._vllm.PROBE_REQUEST

        def after(meta_cls: type, attr: str, change: Callable[[Any], None]) -> Callable[..., None]:
            add = meta_cls.__dict__[attr]

            def changed(self: Any, *a: Any, **kw: Any) -> None:
                add(self, *a, **kw)
                change(self)
            return changed

        def under_a_new_field(meta: Any) -> None:
            # A later vLLM filing pulls under another attribute: reqs_to_recv stays empty.
            meta.reqs_to_pull, meta.reqs_to_recv = meta.reqs_to_recv, type(meta.reqs_to_recv)()

        def mooncake_pulls(meta: Any) -> list[Any]:
            return [p for by_request in meta.reqs_to_recv.values() for p in by_request.values()]

        def nested_once_more(pulls: Callable[[Any], list[Any]]) -> Callable[[Any], None]:
            # [[]] as [[[]]]: has_local_block would call an empty pull one with a block.
            def change(meta: Any) -> None:
                for p in pulls(meta):
                    p.local_block_ids = [p.local_block_ids]
            return change

        def keyed_by_transfer_id(meta: Any) -> None:
            # The gate would hold records under ids the scheduler never reports.
            meta.reqs_to_recv = {engine: {p.transfer_id: p for p in by_request.values()}
                                 for engine, by_request in meta.reqs_to_recv.items()}

        cases = [
            ("pdgate.mooncake", MC, "add_new_req", "under a new field", under_a_new_field, []),
            ("pdgate.mooncake", MC, "add_new_req", "nested once more", nested_once_more(mooncake_pulls),
             [(PROBE, [[[]]])]),
            ("pdgate.mooncake", MC, "add_new_req", "keyed by transfer id", keyed_by_transfer_id, [("probe", [[]])]),
            ("pdgate.nixl", NIXL_META, "add_new_req_to_recv", "under a new field", under_a_new_field, []),
            ("pdgate.nixl", NIXL_META, "add_new_req_to_recv", "nested once more",
             nested_once_more(lambda meta: list(meta.reqs_to_recv.values())), [(PROBE, [[[]]])]),
        ]
        for module, owner, attr, name, change, found in cases:
            with self.subTest(module=module, change=name):
                saved = owner.__dict__[attr]
                try:
                    setattr(owner, attr, after(owner, attr, change))
                    with self.assertRaises(ImportError) as ctx:
                        self.reimport(module)
                    msg = str(ctx.exception)
                    self.assertIsNone(ctx.exception.__cause__, "refused by the walk's exception, not the comparison")
                    self.assertIn(f"vLLM {VERSION}", msg)
                    self.assertIn(f"in the shape the gate walks (a probe pull came back as {found!r})", msg)
                    self.assertIn("completionGate: Disabled", msg)
                finally:
                    setattr(owner, attr, saved)


# vLLM metric names of words.go that a release does not declare (its connector exports no
# stats yet): measured per release, like the tables above.
METRICS_ABSENT = {
    "0.30.0": {"vllm:mooncake_bytes_transferred", "vllm:mooncake_xfer_time_seconds", "vllm:mooncake_num_failed_transfers",
               "vllm:mooncake_num_failed_recvs", "vllm:mooncake_num_kv_expired_reqs"},
    "0.32.0": {"vllm:mooncake_bytes_transferred", "vllm:mooncake_xfer_time_seconds", "vllm:mooncake_num_failed_transfers",
               "vllm:mooncake_num_failed_recvs", "vllm:mooncake_num_kv_expired_reqs"},
    "0.33.0": set(),
}


class MetricNamesTest(unittest.TestCase):
    """The operator reads vLLM's metrics by the names in words.go (the sidecar's KV evidence,
    the chart's dashboard and alerts): each must be one the installed vLLM declares, with the
    prompt token sources the operator sums."""

    def test_words_name_vllms_metrics(self) -> None:
        import re
        from pathlib import Path

        words = (Path(__file__).resolve().parents[1] / "words.go").read_text()
        names = sorted(set(re.findall(r'"(vllm:[a-z_]+)"', words)))
        self.assertIn("vllm:prompt_tokens_by_source_total", names)
        root = Path(vllm.__file__).resolve().parent
        declared = set()
        for py in root.rglob("*.py"):
            declared.update(re.findall(r'name="(vllm:[a-z_]+)"', py.read_text(errors="replace")))
        absent = METRICS_ABSENT.get(VERSION)
        if absent is None:
            raise AssertionError(f"vLLM {VERSION} is not measured in METRICS_ABSENT: measure it and add it")
        for name in names:
            # prometheus_client writes a counter's samples with _total; vLLM declares it without.
            base = name[: -len("_total")] if name.endswith("_total") else name
            with self.subTest(name=name):
                if base in absent:
                    self.assertNotIn(base, declared, f"{base} is declared now: drop it from METRICS_ABSENT")
                else:
                    self.assertIn(base, declared, f"vLLM {VERSION} declares no metric {base}")

    def test_prompt_token_sources(self) -> None:
        from vllm.v1.metrics.stats import PromptTokenStats

        self.assertEqual(set(PromptTokenStats.ALL_SOURCES), {"local_compute", "local_cache_hit", "external_kv_transfer"})


if __name__ == "__main__":
    unittest.main()
