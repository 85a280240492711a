"""The gate's own rules and its reporter, apart from vLLM (test_realvllm.py runs them inside
the installed vLLM). No model of vLLM here: where a test needs a connector class, it is a bare
base class with the two hooks, which is all ``_vllm.gated`` touches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import types
import unittest
from pathlib import Path
from typing import Any, Optional

from pdgate import _vllm
from pdgate import gate as gatemod

PLUGIN_DIR = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GateTest(unittest.TestCase):
    def test_shapes(self) -> None:
        cases = [([], False), ([[]], False), ([[], []], False), (None, False), ((), False),
                 ([3], True), ([0], True), ([[3], []], True), ([[], [0]], True)]
        for blocks, want in cases:
            with self.subTest(blocks=blocks):
                self.assertEqual(gatemod.has_local_block(blocks), want)

    def test_default_ttl_outlives_vllms_timeouts(self) -> None:
        # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s) + the consumer's receive timeout (+60 s).
        self.assertGreater(gatemod.DEFAULT_TTL_SECONDS, 480 + 60)
        self.assertEqual(gatemod.Gate()._ttl, gatemod.DEFAULT_TTL_SECONDS)
        self.assertGreaterEqual(gatemod.DEFAULT_GRACE_STEPS, 8)
        self.assertEqual(gatemod.Gate()._grace, gatemod.DEFAULT_GRACE_STEPS)

    def test_ttl_from_env(self) -> None:
        self.assertEqual(gatemod.ttl_from_env({}), gatemod.DEFAULT_TTL_SECONDS)
        self.assertEqual(gatemod.ttl_from_env({"PDGATE_TTL_SECONDS": "2.5"}), 2.5)
        for bad in ("0", "-1", "soon", "nan"):
            with self.subTest(bad):
                with self.assertRaises(ValueError):
                    gatemod.ttl_from_env({"PDGATE_TTL_SECONDS": bad})

    def test_time_alone_never_drops_a_record(self) -> None:
        clock = Clock()
        g = gatemod.Gate(ttl_seconds=660, clock=clock, grace_steps=3)
        g.observe([("a", [])])
        clock.now += 10 ** 6  # an idle engine: no step, however long
        self.assertIn("a", g)
        g.observe([])  # the next request's step: the deadline is seen passed here
        g.observe([])
        self.assertIn("a", g)
        self.assertEqual(g.filter_finished({"a"}), None, "the held report must be gated")
        self.assertEqual((g.counts.gated, g.counts.expired, len(g)), (1, 0, 0))

    def test_record_goes_after_deadline_and_grace_steps(self) -> None:
        clock = Clock()
        g = gatemod.Gate(ttl_seconds=660, clock=clock, grace_steps=3)
        g.observe([("a", [])])
        clock.now += 659
        g.observe([("b", [[]])])
        clock.now += 2  # a's deadline passed, b's not
        g.observe([])  # the step that sees it passed
        for _ in range(3):  # and the grace steps after it
            self.assertIn("a", g)
            g.observe([])
        self.assertNotIn("a", g)
        self.assertIn("b", g)
        self.assertEqual(g.counts.expired, 1)
        self.assertEqual(g.filter_finished({"a"}), {"a"}, "a report after the grace is passed on")

    def test_a_later_pull_with_blocks_clears_the_record(self) -> None:
        g = gatemod.Gate()
        g.observe([("a", [[]])])
        g.observe([("a", [[9]])])
        self.assertEqual(g.filter_finished({"a"}), {"a"})
        self.assertEqual(g.counts.passed, 1)

    def test_a_re_recorded_pull_keeps_deadline_order(self) -> None:
        clock = Clock()
        g = gatemod.Gate(ttl_seconds=10, clock=clock, grace_steps=1)
        g.observe([("a", []), ("b", [])])
        clock.now += 5
        g.observe([("a", [])])  # a again: its deadline is now later than b's
        clock.now += 6
        g.observe([])
        g.observe([])
        self.assertNotIn("b", g)
        self.assertIn("a", g)

    def test_failures_are_stripped_but_not_counted_as_gated(self) -> None:
        g = gatemod.Gate()
        g.observe([("e", [])])
        for failed, want in (({"e": "x", "k": "y"}, {"k": "y"}), ({"e", "k"}, {"k"})):
            with self.subTest(type(failed).__name__):
                self.assertEqual(g.filter_failed(failed), want)
        self.assertEqual((g.counts.gated, g.counts.failed), (0, 2))
        self.assertIn("e", g, "the record waits for the pull's finished_recving report")

    def test_output_fields_keep_their_shape(self) -> None:
        class Output:
            finished_recving: Optional[set] = {"e", "k"}
            failed_recving: Any = {"e": "x", "k": "y"}

        g = gatemod.Gate()
        g.observe([("e", []), ("k", [[1]])])
        out = Output()
        g.filter_output(out)
        self.assertEqual(out.finished_recving, {"k"})
        self.assertEqual(out.failed_recving, {"k": "y"})
        self.assertEqual(g.counts.as_dict(), {"gated": 1, "passed": 1, "failed": 1, "expired": 0, "send_failures": 0})


class Base:
    """A connector class with the two scheduler hooks the gate wraps."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self.metas: list[Any] = []

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.metas.pop(0)

    def update_connector_output(self, connector_output: Any) -> None:
        pass


class Role:
    def __init__(self, name: str) -> None:
        self.name = name


def pulls(meta: Any) -> Any:
    return iter(meta)


class GatedClassTest(unittest.TestCase):
    def test_reporter_runs_only_in_the_scheduler(self) -> None:
        # A worker process's gate sees no metadata: its zero counts must never reach the
        # sidecar, where they would overwrite the scheduler's.
        cls = _vllm.gated(Base, "GatedTest", "test", pulls)
        os.environ["PDCLUSTER_CONNECTOR_URL"] = "unix:///nonexistent/agent.sock"
        try:
            worker = cls(None, Role("WORKER"), None)
            self.assertIsNone(worker._pdgate_reporter)
            rank2 = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
                data_parallel_rank=6, data_parallel_rank_local=2))
            scheduler = cls(rank2, Role("SCHEDULER"), None)
            self.assertIsNotNone(scheduler._pdgate_reporter)
            scheduler._pdgate_reporter.stop()
            # The rank on this pod, not the global one: the sidecar counts its own engines.
            self.assertEqual(json.loads(scheduler._pdgate_reporter.payload())["dp_rank"], 2)
        finally:
            del os.environ["PDCLUSTER_CONNECTOR_URL"]

    def test_hooks_gate_and_pass(self) -> None:
        cls = _vllm.gated(Base, "GatedTest", "test", pulls)
        c = cls(None, Role("SCHEDULER"))
        c.metas = [[("e", [[]]), ("k", [[3]])]]
        c.build_connector_meta(None)

        class Output:
            finished_recving: Optional[set] = {"e", "k"}

        out = Output()
        c.update_connector_output(out)
        self.assertEqual(out.finished_recving, {"k"})


class PinsTest(unittest.TestCase):
    def test_tested_versions_agree(self) -> None:
        # hack/test-plugin.sh passes the releases it runs; _vllm.TESTED is what the plugin's
        # refusal message and docs claim.
        pins = os.environ.get("PDGATE_TESTED_VERSIONS")
        if pins is None:
            self.fail("PDGATE_TESTED_VERSIONS is not set: run the plugin's tests with hack/test-plugin.sh")
        self.assertEqual(tuple(pins.split()), _vllm.TESTED)


class NoVLLMTest(unittest.TestCase):
    def test_import_fails_closed_without_vllm(self) -> None:
        # A python with the plugin on its path and no vLLM (the standard library's -S keeps
        # site-packages, and with it any vLLM, out).
        for module in ("pdgate.mooncake", "pdgate.nixl"):
            with self.subTest(module):
                p = subprocess.run([sys.executable, "-S", "-c", f"import {module}"], cwd=PLUGIN_DIR,
                                   capture_output=True, text=True, timeout=60)
                self.assertNotEqual(p.returncode, 0)
                self.assertIn("UnsupportedVLLM", p.stderr)
                self.assertIn("vLLM not installed", p.stderr)
                self.assertIn("completionGate: Disabled", p.stderr)


class HeldSendsTest(unittest.TestCase):
    def test_held_until_sent(self) -> None:
        h = gatemod.HeldSends(ttl_seconds=100, clock=Clock())
        h.finished("a", True)
        h.finished("b", True)
        h.finished("c", False)  # nothing waits for a pull: freed at once
        self.assertEqual(len(h), 2)
        h.sent({"a", "unknown"})
        self.assertEqual(len(h), 1)
        h.sent(None)
        h.sent({"b"})
        self.assertEqual(len(h), 0)

    def test_a_lost_report_goes_after_the_ttl(self) -> None:
        clock = Clock()
        h = gatemod.HeldSends(ttl_seconds=100, clock=clock)
        h.finished("a", True)
        clock.now += 60
        h.finished("b", True)
        clock.now += 50
        h.sent(None)  # a's deadline passed; b's did not
        self.assertEqual(len(h), 1)
        clock.now += 60
        h.sent(None)
        self.assertEqual(len(h), 0)

    def test_finished_again_keeps_one_entry(self) -> None:
        h = gatemod.HeldSends(ttl_seconds=100, clock=Clock())
        h.finished("a", True)
        h.finished("a", True)
        self.assertEqual(len(h), 1)
        h.finished("a", False)
        self.assertEqual(len(h), 0)


class ReporterTest(unittest.TestCase):
    def serve_once(self, answer: bytes) -> tuple[str, list[bytes], threading.Thread, socket.socket]:
        d = tempfile.mkdtemp()
        path = os.path.join(d, "agent.sock")
        got: list[bytes] = []
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)

        def serve() -> None:
            conn, _ = srv.accept()
            with conn:
                got.append(conn.recv(65536))
                conn.sendall(answer)

        t = threading.Thread(target=serve)
        t.start()
        return path, got, t, srv

    def test_heartbeat_reaches_the_sidecar(self) -> None:
        path, got, t, srv = self.serve_once(b"HTTP/1.1 204 No Content\r\n\r\n")
        counts = gatemod.Counts()
        counts.gated = 3
        r = gatemod.Reporter(path, counts, "GatedMooncakeConnector", "0.33.0", "SCHEDULER")
        self.assertTrue(r.send_once())
        t.join(5)
        srv.close()
        self.assertIn(b"POST /v1/gate HTTP/1.1", got[0])
        self.assertIn(b'"gated": 3', got[0])
        self.assertNotIn(b"held_sends", got[0])  # no tracker: the field is left out, not 0
        self.assertIn(b'"dp_rank": 0', got[0])
        self.assertEqual(counts.send_failures, 0)

    def test_heartbeat_names_its_data_parallel_rank(self) -> None:
        r = gatemod.Reporter("/nonexistent/agent.sock", gatemod.Counts(), "GatedMooncakeConnector", "0.33.0",
                             "SCHEDULER", dp_rank=3)
        self.assertEqual(json.loads(r.payload())["dp_rank"], 3)

    def test_heartbeat_carries_held_sends(self) -> None:
        path, got, t, srv = self.serve_once(b"HTTP/1.1 204 No Content\r\n\r\n")
        held = gatemod.HeldSends(ttl_seconds=100, clock=Clock())
        held.finished("a", True)
        held.finished("b", True)
        r = gatemod.Reporter(path, gatemod.Counts(), "GatedNixlConnector", "0.33.0", "SCHEDULER", held=held)
        self.assertTrue(r.send_once())
        t.join(5)
        srv.close()
        self.assertIn(b'"held_sends": 2', got[0])

    def test_an_error_answer_is_not_delivered(self) -> None:
        path, _, t, srv = self.serve_once(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
        counts = gatemod.Counts()
        r = gatemod.Reporter(path, counts, "GatedMooncakeConnector", "0.33.0", "SCHEDULER")
        self.assertFalse(r.send_once())
        t.join(5)
        srv.close()
        self.assertEqual(counts.send_failures, 1)

    def test_unreachable_sidecar_is_dropped_and_counted(self) -> None:
        counts = gatemod.Counts()
        r = gatemod.Reporter("/nonexistent/agent.sock", counts, "GatedMooncakeConnector", "0.33.0", "SCHEDULER",
                             timeout_seconds=0.1)
        self.assertFalse(r.send_once())
        self.assertFalse(r.send_once())
        self.assertEqual(counts.send_failures, 2)

    def test_socket_path_from_env(self) -> None:
        self.assertEqual(gatemod.socket_path_from_env({"PDCLUSTER_CONNECTOR_URL": "unix:///var/run/pdcluster/agent.sock"}),
                         "/var/run/pdcluster/agent.sock")
        self.assertIsNone(gatemod.socket_path_from_env({}))


if __name__ == "__main__":
    unittest.main()
