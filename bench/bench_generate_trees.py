"""Whole runs of bench_generate.py from several checkouts, alternating, on one machine.

The queue's own cost (CPU per sample, tokens/s against the direct client) moves with the
machine: the same code measures differently on another host or under another load. Where a
goal was set as "back to what revision X had", the honest test runs X beside today's code on
one host, taking turns, so both see the same machine and the same drift of its load:

    git worktree add /tmp/before ee2e37a && ln -s $PWD/.venv /tmp/before/.venv
    .venv/bin/python bench/bench_generate_trees.py --tree before=/tmp/before --tree now=. \\
        --runs 2 --out bench/results/generate_queue_cost_trees.json -- \\
        --phases throughput --decode-steps-s 0.002 --rounds 4

Each tree runs its own ``bench/bench_generate.py`` (its simulator, producer and workers; the
direct client is the yardstick of each run) with the arguments after ``--``; the table gives,
per tree, every round's worker CPU per 1,000 samples and ratio to the direct client, their
medians, and each median against the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a checkout with its .venv (linked); the first is the reference")
    ap.add_argument("--runs", type=int, default=2, help="turns each tree takes")
    ap.add_argument("--out", default="bench/results/generate_queue_cost_trees.json")
    args = ap.parse_args(own)
    trees = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not name or not path or not (Path(path) / "bench" / "bench_generate.py").is_file():
            ap.error(f"--tree {spec!r}: NAME=PATH of a checkout with bench/bench_generate.py")
        trees[name] = Path(path).resolve()
    args.trees = trees
    return args, rest


def revision(tree: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=False).stdout.strip()
    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != tree:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + (" (modified)" if dirty else "")


def one_run(tree: Path, passthrough: list[str], out: Path) -> dict[str, Any]:
    load = [round(x, 2) for x in os.getloadavg()]
    argv = [str(tree / ".venv" / "bin" / "python"), "bench/bench_generate.py", *passthrough,
            "--out", str(out)]
    result = subprocess.run(argv, cwd=tree, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{tree}: bench_generate.py exited {result.returncode}\n"
                         f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    data = json.loads(out.read_text())
    # "others": the cores other processes of the machine took during each pipeline round
    steps = {step: {"worker_cpu_s_per_1000": got["worker_cpu_s_per_1000"],
                    "ratio_to_direct": got["ratios"],
                    "other_jobs_cores": [r["cores_used"]["others"] for r in got["runs"]
                                         if r["mode"] == "pipeline"]}
             for step, got in data["throughput"].items()}
    return {"load_average_at_start": load, "steps": steps}


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per decode step: every round's figures and their medians, over the tree's runs."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        for step, got in run["steps"].items():
            acc = out.setdefault(step, {key: [] for key in got})
            for key, values in got.items():
                acc[key].extend(values)
    for acc in out.values():
        for key in ("worker_cpu_s_per_1000", "ratio_to_direct"):
            acc[f"{key}_median"] = round(statistics.median(acc[key]), 4)
    return out


def table(trees: dict[str, dict[str, Any]]) -> list[str]:
    first = next(iter(trees.values()))["summary"]
    lines = ["tree | revision | step | worker CPU s / 1k samples (rounds) | median | vs first "
             "| ratio to direct (rounds) | median | other jobs, most cores",
             "--- | --- | --- | --- | --- | --- | --- | --- | ---"]
    for name, tree in trees.items():
        for step, got in tree["summary"].items():
            cpu, ratio = got["worker_cpu_s_per_1000_median"], got["ratio_to_direct_median"]
            ref = first.get(step, {}).get("worker_cpu_s_per_1000_median")
            vs = f"{100 * (cpu / ref - 1):+.1f}%" if ref else "-"
            lines.append(f"{name} | {tree['revision']} | {step} | "
                         f"{', '.join(f'{x:.2f}' for x in got['worker_cpu_s_per_1000'])} | "
                         f"{cpu:.2f} | {vs} | "
                         f"{', '.join(f'{x:.3f}' for x in got['ratio_to_direct'])} | {ratio:.3f} | "
                         f"{max(got['other_jobs_cores']):.2f}")
    return lines


def main(argv: list[str]) -> int:
    args, passthrough = parse_args(argv)
    started = time.monotonic()
    results = {name: {"path": str(path), "revision": revision(path), "runs": []}
               for name, path in args.trees.items()}
    with tempfile.TemporaryDirectory(prefix="bench-trees-") as tmp:
        for turn in range(1, args.runs + 1):
            for name, path in args.trees.items():
                print(f"run {turn}: {name} ({results[name]['revision']}) ...", flush=True)
                results[name]["runs"].append(
                    one_run(path, passthrough, Path(tmp) / f"{name}-{turn}.json"))
    for tree in results.values():
        tree["summary"] = summary(tree["runs"])
    lines = table(results)
    print("\n".join(lines))
    out = {"command": " ".join([Path(sys.argv[0]).as_posix(), *argv]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform()},
           "runtime_s": round(time.monotonic() - started), "trees": results, "table": lines}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
