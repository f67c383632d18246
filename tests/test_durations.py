"""The suite's own order: longest modules first, from a measured --durations report."""

from __future__ import annotations

from types import SimpleNamespace

from durations import SECONDS_FILE, UNMEASURED_S, load, longest_first, module_seconds

REPORT = """\
============================= slowest durations ==============================
246.28s call     tests/real_sglang/test_demo.py::test_the_demo_generates
90.10s setup    tests/real_vllm/test_vllm_server.py::test_the_read_only_routes
30.00s call     tests/real_vllm/test_vllm_server.py::test_a_kill[vllm]
0.20s teardown tests/real_vllm/test_vllm_server.py::test_a_kill[vllm]
1.50s call     tests/test_small.py::test_one
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_a_report_sums_each_module_s_setup_call_and_teardown() -> None:
    assert module_seconds(REPORT) == {"tests/real_sglang/test_demo.py": 246.3,
                                      "tests/real_vllm/test_vllm_server.py": 120.3,
                                      "tests/test_small.py": 1.5}


def test_modules_go_longest_first_and_each_stays_together_in_its_order() -> None:
    # Given: items of four modules in collection order, one module never measured
    names = ["tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/c.py::t1",
             "tests/c.py::t2", "tests/c.py::t3", "tests/new.py::t1"]
    items = [SimpleNamespace(nodeid=name) for name in names]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 200.0, "tests/c.py": 40.0}

    # When / Then: b, c, the unmeasured one (UNMEASURED_S), then a
    assert UNMEASURED_S < 40.0
    assert [i.nodeid for i in longest_first(items, seconds)] == [
        "tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t2", "tests/c.py::t3",
        "tests/new.py::t1", "tests/a.py::t1", "tests/a.py::t2"]


def test_the_recorded_file_names_modules_that_exist() -> None:
    seconds = load()
    assert seconds, f"{SECONDS_FILE} is missing or empty"
    root = SECONDS_FILE.parent.parent
    assert all((root / module).is_file() for module in seconds), \
        [m for m in seconds if not (root / m).is_file()]
