"""The gate through a fake of vLLM's scheduler that keeps its asserts. Every empty-pull case
runs twice: the stock connector must kill the fake engine, the gated one must not."""

from __future__ import annotations

import importlib
import os
import socket
import tempfile
import threading
import unittest
from typing import Any, Callable

from pdgate import gate as gatemod
from tests import fakevllm as fv


def connector_classes(flow: str) -> tuple[type, type]:
    """(stock, gated) for flow, on a freshly installed fake vLLM."""
    fv.install()
    if flow == "mooncake":
        mod = importlib.import_module("pdgate.mooncake")
        return mod.MooncakeConnector, mod.GatedMooncakeConnector
    mod = importlib.import_module("pdgate.nixl")
    return mod.NixlConnector, mod.GatedNixlConnector


def engine(cls: type) -> fv.Scheduler:
    return fv.Scheduler(cls(None, fv.KVConnectorRole.SCHEDULER))


def report(s: fv.Scheduler, meta: Any, failed: frozenset = frozenset(), failed_as_dict: bool = False) -> None:
    """One step of the worker's reports reaching the scheduler."""
    done, bad = type(s.connector).worker_finished(meta, failed)
    out = fv.KVConnectorOutput(finished_recving=done or None,
                               failed_recving=({r: "handshake failed" for r in bad} if failed_as_dict else bad) or None)
    s.update_from_kv_xfer_finished(out)


# Each scenario drives a fake engine and returns nothing; an engine that dies raises.
def abort_before_first_schedule(s: fv.Scheduler) -> None:
    s.add_request("r")
    meta = s.finish_requests("r")  # cleanup pull: no local blocks
    report(s, meta)


def rejected_request(s: fv.Scheduler) -> None:
    # notify_kv_transfer_request_rejected: abort_immediately, before any schedule.
    s.add_request("r")
    report(s, s.finish_requests("r"))


def full_local_prefix_hit(s: fv.Scheduler) -> None:
    s.add_request("r")
    report(s, s.schedule("r", [[]]))  # nothing to load: the request is RUNNING


def failed_empty_pull(s: fv.Scheduler) -> None:
    s.add_request("r")
    report(s, s.finish_requests("r"), failed=frozenset({"r"}))


# scenario -> the request's state afterwards (None: freed)
EMPTY_PULLS: dict[str, tuple[Callable[[fv.Scheduler], None], Any]] = {
    "abort before first schedule": (abort_before_first_schedule, None),
    "rejected request": (rejected_request, None),
    "full local prefix hit": (full_local_prefix_hit, fv.RequestStatus.RUNNING),
}


class EmptyPullsTest(unittest.TestCase):
    def test_stock_mooncake_dies_and_gated_survives(self) -> None:
        for name, (scenario, after) in EMPTY_PULLS.items():
            with self.subTest(name):
                stock, gated = connector_classes("mooncake")
                with self.assertRaises(fv.AssertionInEngine):
                    scenario(engine(stock))
                s = engine(gated)
                scenario(s)
                self.assertEqual(s.connector._pdgate.counts.gated, 1)
                self.assertEqual(s.requests.get("r"), after)
                self.assertEqual(len(s.connector._pdgate), 0, "record kept after its report")

    def test_failed_empty_pull_both_flows_and_shapes(self) -> None:
        for flow in ("mooncake", "nixl"):
            for as_dict in (False, True):
                with self.subTest(flow=flow, failed_recving="dict" if as_dict else "set"):
                    stock, gated = connector_classes(flow)
                    s = engine(stock)
                    s.add_request("r")
                    meta = s.finish_requests("r")
                    with self.assertRaises(fv.AssertionInEngine):
                        report(s, meta, failed=frozenset({"r"}), failed_as_dict=as_dict)
                    s = engine(gated)
                    s.add_request("r")
                    meta = s.finish_requests("r")
                    report(s, meta, failed=frozenset({"r"}), failed_as_dict=as_dict)
                    self.assertEqual(s.connector._pdgate.counts.gated_failures, 1)

    def test_nixl_successful_empty_pull_was_already_quiet(self) -> None:
        stock, gated = connector_classes("nixl")
        for cls in (stock, gated):
            s = engine(cls)
            full_local_prefix_hit(s)
            self.assertEqual(s.requests["r"], fv.RequestStatus.RUNNING)


class PullsWithBlocksTest(unittest.TestCase):
    """Pulls with a local block are reported exactly as vLLM does."""

    def test_normal_pull_is_reported(self) -> None:
        for flow in ("mooncake", "nixl"):
            with self.subTest(flow):
                _, gated = connector_classes(flow)
                s = engine(gated)
                s.add_request("r")
                report(s, s.schedule("r", [[4, 5]]))
                self.assertIn("r", s.finished_recving_kv_req_ids)
                self.assertEqual(s.connector._pdgate.counts.passed, 1)

    def test_abort_while_waiting_is_freed_by_the_late_report(self) -> None:
        for cls in connector_classes("mooncake"):
            s = engine(cls)
            s.add_request("r")
            meta = s.schedule("r", [[7]])
            s.finish_requests("r")  # delayed free: blocks held until the report
            self.assertIn("r", s.requests)
            report(s, meta)
            self.assertNotIn("r", s.requests, f"{cls.__name__} left the aborted request behind")

    def test_failed_pull_with_blocks_is_reported_as_failed(self) -> None:
        _, gated = connector_classes("mooncake")
        s = engine(gated)
        s.add_request("r")
        report(s, s.schedule("r", [[3], []]), failed=frozenset({"r"}), failed_as_dict=True)
        self.assertIn("r", s.failed_recving_kv_req_ids)
        self.assertEqual(s.connector._pdgate.counts.failed, 1)

    def test_several_workers_gate_the_aggregated_report_once(self) -> None:
        _, gated = connector_classes("mooncake")
        s = engine(gated)
        s.add_request("empty")
        s.add_request("full")
        meta_empty = s.finish_requests("empty")
        meta_full = s.schedule("full", [[1, 2]])
        agg = fv.Aggregator(workers=4)
        for worker in range(4):
            done = set()
            for meta in (meta_empty, meta_full):
                d, _ = type(s.connector).worker_finished(meta)
                done |= d
            passed = agg.aggregate([done])
            s.update_from_kv_xfer_finished(fv.KVConnectorOutput(finished_recving=passed or None))
            if worker < 3:
                self.assertEqual(s.connector._pdgate.counts.gated, 0)
        self.assertEqual((s.connector._pdgate.counts.gated, s.connector._pdgate.counts.passed), (1, 1))
        self.assertIn("full", s.finished_recving_kv_req_ids)


class GateTest(unittest.TestCase):
    def test_shapes(self) -> None:
        cases = [([], False), ([[]], False), ([[], []], False), (None, False), ((), False),
                 ([3], True), ([0], True), ([[3], []], True), ([[], [0]], True)]
        for blocks, want in cases:
            with self.subTest(blocks=blocks):
                self.assertEqual(gatemod.has_local_block(blocks), want)

    def test_records_expire(self) -> None:
        now = [1000.0]
        g = gatemod.Gate(ttl_seconds=660, clock=lambda: now[0])
        g.observe([("a", [])])
        now[0] += 659
        g.observe([("b", [[1]])])
        self.assertEqual(len(g), 1)
        now[0] += 2
        g.observe([])
        self.assertEqual(len(g), 0)
        self.assertEqual(g.counts.expired, 1)
        self.assertEqual(g.filter_finished({"a"}), {"a"}, "an expired record no longer gates")

    def test_a_later_pull_with_blocks_clears_the_record(self) -> None:
        g = gatemod.Gate()
        g.observe([("a", [[]])])
        g.observe([("a", [[9]])])
        self.assertEqual(g.filter_finished({"a"}), {"a"})

    def test_output_fields_keep_their_shape(self) -> None:
        g = gatemod.Gate()
        g.observe([("e", [])])
        out = fv.KVConnectorOutput(finished_recving={"e"}, failed_recving={"e": "x", "k": "y"})
        g.filter_output(out)
        self.assertIsNone(out.finished_recving)
        self.assertEqual(out.failed_recving, {"k": "y"})


class FailClosedTest(unittest.TestCase):
    def test_old_module_layout_loads(self) -> None:
        fv.install(layout="old")
        mod = importlib.import_module("pdgate.mooncake")
        self.assertTrue(issubclass(mod.GatedMooncakeConnector, mod.MooncakeConnector))
        importlib.import_module("pdgate.nixl")

    def test_missing_surface_refuses_to_load_naming_the_version(self) -> None:
        for module, drop in [("pdgate.mooncake", "MooncakeConnector.update_connector_output"),
                             ("pdgate.mooncake", "PullReqMeta.local_block_ids"),
                             ("pdgate.nixl", "NixlConnector.build_connector_meta")]:
            with self.subTest(drop):
                fv.install(version="0.99.1", drop=(drop,))
                with self.assertRaises(ImportError) as ctx:
                    importlib.import_module(module)
                self.assertIn("vLLM 0.99.1", str(ctx.exception))
                self.assertIn(drop.split(".")[1], str(ctx.exception))

    def test_no_vllm_at_all(self) -> None:
        fv.uninstall()
        with self.assertRaises(ImportError):
            importlib.import_module("pdgate.mooncake")

    def tearDown(self) -> None:
        fv.uninstall()


class ReporterTest(unittest.TestCase):
    def test_heartbeat_reaches_the_sidecar(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "agent.sock")
            got: list[bytes] = []
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(path)
            srv.listen(1)

            def serve() -> None:
                conn, _ = srv.accept()
                with conn:
                    got.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")

            t = threading.Thread(target=serve)
            t.start()
            counts = gatemod.Counts()
            counts.gated = 3
            r = gatemod.Reporter(path, counts, "GatedMooncakeConnector", "0.27.0", "SCHEDULER")
            self.assertTrue(r.send_once())
            t.join(5)
            srv.close()
            self.assertIn(b"POST /v1/gate HTTP/1.1", got[0])
            self.assertIn(b'"gated": 3', got[0])
            self.assertEqual(counts.send_failures, 0)

    def test_unreachable_sidecar_is_dropped_and_counted(self) -> None:
        counts = gatemod.Counts()
        r = gatemod.Reporter("/nonexistent/agent.sock", counts, "GatedMooncakeConnector", "0.27.0", "SCHEDULER",
                             timeout_seconds=0.1)
        self.assertFalse(r.send_once())
        self.assertFalse(r.send_once())
        self.assertEqual(counts.send_failures, 2)

    def test_engine_runs_on_when_the_sidecar_is_gone(self) -> None:
        fv.install()
        os.environ["PDCLUSTER_CONNECTOR_URL"] = "unix:///nonexistent/agent.sock"
        try:
            mod = importlib.import_module("pdgate.mooncake")
            s = engine(mod.GatedMooncakeConnector)
            abort_before_first_schedule(s)
            self.assertIsNotNone(s.connector._pdgate_reporter)
            s.connector._pdgate_reporter.stop()
        finally:
            del os.environ["PDCLUSTER_CONNECTOR_URL"]
            fv.uninstall()

    def test_socket_path_from_env(self) -> None:
        self.assertEqual(gatemod.socket_path_from_env({"PDCLUSTER_CONNECTOR_URL": "unix:///var/run/pdcluster/agent.sock"}),
                         "/var/run/pdcluster/agent.sock")
        self.assertIsNone(gatemod.socket_path_from_env({}))


if __name__ == "__main__":
    unittest.main()
