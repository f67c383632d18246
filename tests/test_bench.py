"""The benchmark scripts run as documented (small sizes): their figures come from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_fixture import skip_or_fail
from vllm_fixture import vllm_python

from cli import sglang
from cli.stack import REPO


def test_bench_ledger_measures_admission_and_traffic(tmp_path: Path) -> None:
    out = tmp_path / "ledger.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_ledger.py", "--in-flight", "0,1000", "--calls", "30",
         "--samples", "40", "--threads", "8", "--old", "", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["in_flight"]: r for r in data["server_time"]}
    assert set(rows) == {0, 1000}
    # Buckets, not entries: a thousand requests in flight read as a few dozen fields
    assert 0 < rows[1000]["buckets"] < 100
    assert rows[1000]["admit_us"] > 0 and rows[1000]["commit_us"] > 0
    # Every cap distinct: still buckets by (start, cap class), not a bucket per request
    distinct = [r for r in data["distinct_caps"] if r["caps"] == "distinct"]
    assert len(distinct) == 3 and all(0 < r["fields"] < 1000 / 4 for r in distinct)
    assert all(r["refused_us"] > 0 and r["parked_commit_us"] > 0 for r in distinct)
    assert data["traffic"]["samples"] == 40
    assert 0 < data["traffic"]["round_trips_per_sample"] <= 4
    assert "| in flight |" in result.stdout


def test_bench_generate_measures_the_pipeline_the_client_and_the_celery_floor(
        tmp_path: Path) -> None:
    out = tmp_path / "generate.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_generate.py", "--phases", "throughput,http,floor",
         "--decode-steps-s", "0.002", "--rounds", "1", "--prompts", "120", "--http-calls", "10",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    tp = data["throughput"]["2ms"]
    assert len(tp["ratios"]) == 1 and tp["ratios"][0] > 0
    assert tp["worker_cpu_s_per_1000"][0] > 0 and tp["direct_cpu_s_per_1000"][0] > 0
    # Both sides ran the same requests (the long prompts too) and count the same tokens: the
    # generated ones, whatever the budget counts
    pipe, direct = tp["runs"]
    assert pipe["samples"] == 120 and direct["failed"] == 0
    assert pipe["tokens"] == direct["tokens"] == pipe["sim_tokens_generated"]
    # The no-op worker held each task as long as the pipeline's median request, and ran all
    floor = data["floor"]["2ms"]
    assert floor["tasks"] == 120
    assert floor["hold_s"] == round(tp["runs"][0]["server"]["request_s_median"], 4) > 0
    assert floor["worker_cpu_s_per_1000"] > 0 and floor["floor_over_direct"] > 0
    http = data["http"]["median_cpu_ms_per_call"]
    assert http["requests"] > 0 and http["client"] > 0
    assert "no-op worker / direct client CPU per sample" in result.stdout


def checkout_of_head(folder: Path) -> Path:
    """Another checkout of the code (this commit's), its .venv linked."""
    folder.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True,
                             check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=120)
    (folder / ".venv").symlink_to(Path(sys.prefix))
    return folder


def test_bench_generate_runs_two_checkouts_side_by_side(tmp_path: Path) -> None:
    # Given: another checkout of the code
    base = checkout_of_head(tmp_path / "base")
    out = tmp_path / "generate.json"
    # When: the throughput phase runs one short worker from it and one from this tree
    result = subprocess.run(
        [sys.executable, "bench/bench_generate.py", "--phases", "throughput",
         "--decode-steps-s", "0.002", "--rounds", "1", "--prompts", "120",
         "--short-workers", "2", "--base-tree", str(base), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Then: each worker's CPU is divided by the samples it stored, which add up to the
    # short queue's
    pipe = json.loads(out.read_text())["throughput"]["2ms"]["runs"][0]
    both = pipe["side_by_side"]
    assert both["short1"]["tree"] == str(base) and both["short2"]["tree"] == "this tree"
    assert both["short1"]["samples"] + both["short2"]["samples"] == pipe["short"]
    assert all(w["samples"] > 0 and w["cpu_s_per_1000"] > 0 for w in both.values())
    assert "short1 (" in result.stdout


def test_bench_generate_trees_alternates_whole_runs_of_each_checkout(tmp_path: Path) -> None:
    # Given: two checkouts, another one and this one
    other = checkout_of_head(tmp_path / "other")
    out = tmp_path / "trees.json"
    # When: each takes one turn of a one-round throughput run
    result = subprocess.run(
        [sys.executable, "bench/bench_generate_trees.py", "--tree", f"other={other}",
         "--tree", f"this={REPO}", "--runs", "1", "--out", str(out), "--",
         "--phases", "throughput", "--decode-steps-s", "0.002", "--rounds", "1",
         "--prompts", "120"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Then: each tree's round is its own run's figures, compared with the first tree's
    trees = json.loads(out.read_text())["trees"]
    assert list(trees) == ["other", "this"]
    assert trees["other"]["revision"] == "not a git checkout"
    for tree in trees.values():
        (run,) = tree["runs"]
        got = tree["summary"]["2ms"]
        assert got["worker_cpu_s_per_1000"] == run["steps"]["2ms"]["worker_cpu_s_per_1000"]
        assert len(got["ratio_to_direct"]) == 1 and got["ratio_to_direct"][0] > 0
        assert got["worker_cpu_s_per_1000_median"] > 0
    assert "| +0.0% |" in next(line for line in result.stdout.splitlines()
                                if line.startswith("other |"))
    assert any(line.startswith("this |") for line in result.stdout.splitlines())


def test_bench_generate_trees_names_a_tree_that_is_no_checkout(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "bench/bench_generate_trees.py", "--tree", f"gone={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"--tree 'gone={tmp_path}': NAME=PATH of a checkout" in result.stderr


def test_bench_scale_measures_every_phase_and_fits_a_line(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_scale.py", "--prompts", "300,600", "--records",
         "300,600", "--run-samples", "150", "--simulators", "1", "--short-concurrency", "8",
         "--long-concurrency", "4", "--target", "1000000", "--workdir", str(tmp_path),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    phases = data["phases"]
    assert set(phases) == {"produce", "rerun", "status", "run", "rebuild", "merge", "prepare"}
    for phase in ("produce", "rerun", "rebuild", "merge", "prepare"):
        assert set(phases[phase]["sizes"]) == {"300", "600"}, phase
        for figures in phases[phase]["sizes"].values():
            assert figures["seconds"] > 0 and figures["peak_rss_mb"] > 0
        # Two sizes, a target beyond them: every fitted figure is read at the target
        assert phases[phase]["fit"]["seconds"]["extrapolated_at"] == 1_000_000
    produced = phases["produce"]["sizes"]["600"]
    assert produced["enqueued"] == 600 and produced["queued"]["long"] > 0
    assert produced["redis_mb"] > 0
    assert phases["rerun"]["sizes"]["600"]["enqueued"] == 0  # all pending: nothing new
    status = phases["status"]["sizes"]["600"]
    assert status["pending"] == 600 and len(status["status_s"]) == 3
    assert set(status["flower"]) == {"/api/workers", "/api/workers?refresh=1",
                                     "/api/queues/length", "/api/tasks?limit=100"}
    run = phases["run"]["sizes"]["600"]
    assert run["samples"] >= 150 and run["samples_per_s"] > 0
    assert run["redis"]["script_calls_per_s"] > 0 and run["redis"]["cpu_cores"] >= 0
    assert set(run["with_workers"]["flower"]) == set(status["flower"])
    assert phases["rebuild"]["sizes"]["600"]["done"] == 600
    assert phases["merge"]["sizes"]["600"]["records"] == 600
    assert phases["prepare"]["sizes"]["600"]["samples"] == 600
    assert "(extrapolated)" in result.stdout
    # What the bench wrote is gone
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]


def test_bench_ledger_runs_another_revisions_scripts_on_every_fill(tmp_path: Path) -> None:
    out = tmp_path / "caps.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_ledger.py", "--parts", "caps", "--in-flight", "300",
         "--calls", "10", "--rounds", "2", "--before", "HEAD", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["distinct_caps"]
    # both trees, every fill, both rounds; HEAD's own layout writes about the same bucket
    # fields (a fill made a moment later may cross one more boundary of the time grid)
    assert len(rows) == 2 * 3 * 2 * 2
    ours = {(r["caps"], r["fill"], r["round"]): r["fields"] for r in rows
            if r["code"] == "this tree"}
    theirs = {(r["caps"], r["fill"], r["round"]): r["fields"] for r in rows
              if r["code"] == "before (HEAD)"}
    assert ours.keys() == theirs.keys() and all(f > 0 for f in ours.values())
    assert all(abs(ours[k] - theirs[k]) <= 2 for k in ours), (ours, theirs)
    assert "median of the rounds" in result.stdout


def test_bench_memory_measures_rebuild_merge_and_prepare_with_the_tokenizer(
        tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_memory.py", "--only", "1000", "--pending", "200",
         "--workdir", str(tmp_path), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    case = json.loads(out.read_text())["cases"][0]
    assert case["records"] == 1000 and case["prepare"]["conversations"] == 1000
    for step in ("rebuild", "merge", "prepare"):
        assert 0 < case[step]["base_mb"] <= case[step]["peak_mb"] < 500, step
    assert "goal <= 500 MB: met" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["memory.json"]  # records deleted


@pytest.mark.net
def test_bench_fleet_scale_measures_a_whole_run_across_hosts(
        tmp_path: Path, can_make_hosts: None) -> None:
    out = tmp_path / "fleet.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_fleet_scale.py", "--quick", "--workdir", str(tmp_path),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["prompts"] == 1000 and data["problems"] == []
    for step in ("produce", "run_command", "merge", "prepare"):
        assert data[step]["seconds"] > 0 and data[step]["peak_rss_mb"] > 0, step
    generate = data["generate"]
    assert generate["samples_per_s"] > 0 and generate["redis"]["script_calls_per_s"] > 0
    assert set(generate["peak_rss_mb"]) == {"short-w1", "long-w1", "short-w2", "long-w2",
                                            "sim0", "sim1"}
    assert all(mb > 0 for mb in generate["peak_rss_mb"].values())
    memory = data["redis_memory_mb"]
    assert memory["used_memory_peak"] >= memory["used_memory_at_end"] > 0
    # Admission and commit times from the run's own slowlog, none of it lost
    scripts = data["ledger_scripts_redis_side"]
    assert scripts["admit"]["calls"] >= generate["samples"]
    assert scripts["commit"]["calls"] >= generate["samples"]
    for name in ("admit", "commit"):
        assert 0 < scripts[name]["p50_us"] <= scripts[name]["p99_us"], name
    assert data["slowlog"]["lost"] == 0
    assert data["celery_tasks"]["received"] >= data["prompts"]
    assert data["celery_tasks"]["ends"]["succeeded: stored"] == generate["samples"]
    min_load = data["load_average_1min"]["min"]
    assert 0 <= min_load <= data["load_average_1min"]["max"]
    # Every sample counted once: two datasets closed by their budget, two finished
    datasets = data["datasets"]
    closed = [d for d in datasets.values() if d["over_budget_pct"] is not None]
    assert len(datasets) == 4 and len(closed) == 2
    assert all(d["closed"] and d["samples"] < d["prompts"] for d in closed)
    for name, d in datasets.items():
        assert d["samples"] == d["merged"] == d["merged_ids"], name
        assert d["tokens"] == d["merged_tokens"] and d["pending"] == d["in_flight"] == 0
        if d["over_budget_pct"] is None:
            assert d["samples"] == d["prompts"], name
    assert sum(d["samples"] for d in datasets.values()) == generate["samples"] \
        == data["prepare"]["samples"]
    assert data["disk_written_mb"]["records"] > 0
    assert "| admit.lua Redis-side" in result.stdout
    # What the bench made is gone: files and namespaces
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.json"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert f"dgn{data['bench_pid']}-" not in namespaces.stdout


@pytest.mark.parametrize("backend", [[], ["--backend", "hf-tp", "--ranks", "2"]],
                         ids=["hf", "hf-tp-2-ranks"])
def test_bench_extract_measures_the_forward_and_the_pipeline(tmp_path: Path,
                                                             backend: list[str]) -> None:
    # bench/device_extract.sh's two runs, tiny and on the CPU (the replica's over gloo)
    out = tmp_path / "extract.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.bench_extract", "--tiny", "--n-samples", "4",
         "--naive-samples", "1", "--work-dir", str(tmp_path), *backend, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    phases = json.loads(out.read_text())["phases"]
    assert phases["forward"]["tokens"] == phases["pipeline"]["tokens"] > 0
    assert phases["pipeline"]["tokens_per_s"] > 0 and phases["forward"]["tokens_per_s"] > 0
    assert phases["pipeline"]["disk_bytes_per_token"] > 0  # the files were written


def test_bench_imports_times_a_worker_s_imports_with_and_without_bytecode(
        tmp_path: Path) -> None:
    out = tmp_path / "imports.json"
    result = subprocess.run([sys.executable, "bench/bench_imports.py", "--only", "worker",
                             "--rounds", "1", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["cases"]
    assert row["case"] == "worker" and row["compiled_s"][0] > 0 and row["source_s"][0] > 0
    assert "| worker |" in result.stdout


@pytest.mark.parametrize("venv", ["project", "sglang", "vllm"])
def test_every_virtualenv_holds_the_bytecode_of_what_its_processes_import(venv: str) -> None:
    # `make install`/`sglang-env`/`vllm-env` compile at install (uv --compile-bytecode): where
    # PYTHONDONTWRITEBYTECODE is set, a venv without .pyc compiles on every import
    # (bench/bench_imports.py: 2.2x the time for SGLang's server)
    if venv == "sglang":
        if reason := sglang.unavailable_reason():
            skip_or_fail(reason)
        python, package = str(sglang.sglang_python()), "sglang"
    elif venv == "vllm":
        python, package = vllm_python(), "vllm"
    else:
        python, package = sys.executable, "transformers"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    found = subprocess.run(
        [python, "-c", "import importlib.util as u, sys; s = u.find_spec(sys.argv[1]); "
         "print(s.origin); print(u.cache_from_source(s.origin))", package],
        env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    source, compiled = map(Path, found)
    assert source.is_file() and compiled.is_file(), f"no bytecode for {source}: {compiled}"


def test_bench_window_runs_capped_and_today_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "window.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_window.py", "--budget", "8000", "--prompts", "30",
         "--windows", "2048", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    capped, today = rows["capped"], rows["today"]
    # both closed on the trainable budget; the capped arm generated only what trains (and
    # each row's last token, whose loss SpecForge zeroes)
    assert capped["trainable"] >= 8000 and today["trainable"] >= 8000
    assert capped["generated_server"] == capped["trainable"] + capped["samples"]
    assert capped["caps_inside_window"] == 1
    assert today["generated_server"] > today["trainable"]
    assert "| 2,048 | capped |" in result.stdout


def test_bench_state_copy_measures_both_copy_paths_and_they_write_the_same_bytes(
        tmp_path: Path) -> None:
    out = tmp_path / "state_copy.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_state_copy.py", "--hidden", "64", "--cases", "1x64,6x256",
         "--chunk-tokens", "32", "--buffers", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bytes_per_position"] == 4 * 64 * 2
    rows = {r["case"]: r for r in data["cases"]}
    assert set(rows) == {"1x64", "6x256"} and rows["6x256"]["tokens"] == 1536
    for row in rows.values():
        assert row["same_bytes"]
        assert row["before"]["host_peak_mb"] >= 0 and row["after"]["host_peak_mb"] >= 0
        assert row["after"]["pool_mb"] == round(2 * 2 * 4 * 16 * 64 * 2 / 2**20, 1)
    assert "| requests ending together |" in result.stdout


def test_bench_state_check_times_the_check_per_sample(tmp_path: Path) -> None:
    out = tmp_path / "state_check.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_state_check.py", "--shapes", "tiny", "--positions", "4,8",
         "--repeats", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["positions"]) for r in rows] == [("tiny", 4), ("tiny", 8)]
    assert all(r["median_s"] > 0 and r["gflop"] > 0 for r in rows)
    assert "| tiny (512 x 128) | cpu | 8 |" in result.stdout


def test_bench_state_check_memory_bounds_the_peak_by_chunks(tmp_path: Path) -> None:
    out = tmp_path / "state_check_memory.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_state_check_memory.py", "--shape", "tiny", "--positions",
         "4096", "--chunk", "256", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    whole, chunked = json.loads(out.read_text())["rows"]
    assert (whole["chunked"], chunked["chunked"]) == (False, True)
    assert chunked["chunk_positions"] == 256 and whole["logits_f32_mb"] == 8.0
    # all at once holds the 8 MB of logits (twice); 256 positions a chunk hold 0.5 MB
    assert whole["peak_mb"] >= 8 and chunked["peak_mb"] < whole["peak_mb"]
    assert "| tiny (512 x 128) | 4,096 | 8 MB | 256 |" in result.stdout


def test_bench_state_check_tolerance_sets_a_second_forward_against_a_shift(
        tmp_path: Path) -> None:
    out = tmp_path / "state_check_tolerance.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_state_check_tolerance.py", "--positions", "40", "--out",
         str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["positions"] for r in rows] == [40, 40]
    # a float32 forward against bf16 logits: within the recompute allowance; a shift: far out
    assert all(0 < r["rtol_units_max"] < 4 and r["shifted_gap_max"] > 10 * r["gap_max"]
               for r in rows)
    assert "| 256, 64, 6 | 40 |" in result.stdout


def test_bench_capture_disk_builds_kept_and_freed_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "capture_disk.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_capture_disk.py", "--samples", "20", "--positions", "64",
         "--hidden", "64", "--dir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    kept, freed = json.loads(out.read_text())["runs"]
    assert kept["keep_captured_states"] and not freed["keep_captured_states"]
    # kept: the files and the rows stay; freed: the rows and a mark per file
    assert kept["left_bytes"] >= kept["states_bytes"] + kept["rows_bytes"]
    assert freed["left_bytes"] < freed["states_bytes"] + freed["rows_bytes"]
    assert all(r["peak_bytes"] >= r["rows_bytes"] > 0 for r in (kept, freed))
    assert "| keep_captured_states |" in result.stdout


def test_bench_stream_runs_the_file_build_the_store_and_the_stock_consumer_side_by_side(
        tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_stream.py", "--samples", "6", "--positions", "32",
         "--hidden", "32", "--bound-samples", "2", "--dir", str(tmp_path / "work"),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    files, store, consumer = data["runs"]
    assert [r["build"] for r in data["runs"]] == ["file", "store", "consumer"]
    # the file build keeps every sample on disk
    assert files["left_disk_bytes"] >= 6 * data["sample_store_bytes"]
    for stream in (store, consumer):
        assert stream["samples_per_s"] > 0 and stream["steady_samples_per_s"] >= 0
        # the bound (2 samples of 6, all trained) was reached and never passed: the
        # producer waited for acknowledgements
        assert stream["peak_resident_bytes"] == stream["bound_bytes"] \
            == 2 * data["sample_store_bytes"]
        assert stream["peak_keys"] > 0 and stream["peak_store_allocated_bytes"] > 0
    # the stand-in got every tensor of every sample back from the store
    assert store["got_bytes"] == 6 * data["sample_store_bytes"]
    assert consumer["consumer_start_s"] > 0 and consumer["checkpoint_bytes"] > 0
    assert "| build | samples/s |" in result.stdout


def test_bench_json_codec_times_json_and_the_codec_on_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "json_codec.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_json_codec.py", "--ids", "20", "--number", "5",
         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"record line", "/generate body", "answer parse"}
    assert all(r["json_ms"] > 0 and r["json_codec_ms"] > 0 for r in rows.values())
