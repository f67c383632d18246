"""The tables bench/bench_capture.py prints from its result."""

from __future__ import annotations

from typing import Any


def report(result: dict[str, Any]) -> str:
    return "\n\n".join((_generation(result), _capacity(result), _end_to_end(result),
                        _kimi(result["kimi_node"]),
                        "datagen estimate, without capture:\n" + result["estimate"]["without"]
                        + "\ndatagen estimate --capture:\n" + result["estimate"]["with"]))


def _generation(result: dict[str, Any]) -> str:
    c, r = result["conditions"], result["ratios"]
    lines = [f"generation: {c['prompts']} requests a block, {c['concurrency']} in flight, "
             f"{c['min_prompt']}-{c['max_prompt']} prompt + {c['output_len']} output tokens, "
             f"Llama H={c['hidden']} L={c['layers']} {c['dtype']}",
             f"{'server':>6} {'kind':>4} {'block':>5} {'mode':>8} {'output tok/s':>13} "
             f"{'s':>7} {'states MB':>10} {'server CPU ms/tok':>18}"]
    kinds = {s["index"]: s["kind"] for s in result["servers"]}
    for b in result["blocks"]:
        lines.append(f"{b['server']:>6} {kinds[b['server']]:>4} {b['block']:>5} {b['mode']:>8} "
                     f"{b['output_tokens_per_s']:>13,.0f} {b['seconds']:>7.1f} "
                     f"{b['states_bytes'] / 1e6:>10.1f} "
                     f"{b.get('server_cpu_ms_per_token', float('nan')):>18.2f}")
    lines.append(f"capture / off (server without connector), per (round, block): "
                 f"{r['capture_over_off']}, median {r['median_capture_over_off']:.3f}")
    lines.append(f"capture / none (same capture server, no kv_transfer_params): "
                 f"{r['capture_over_none']}, median {r['median_capture_over_none']:.3f}")
    lines.append(f"none / off (the method and connector, no file asked): "
                 f"{r['none_over_off']}, median {r['median_none_over_off']:.3f}")
    for pair in ("capture_over_off", "capture_over_none", "none_over_off"):
        if f"cpu_{pair}" in r:
            lines.append(f"server CPU per output token, {pair.replace('_over_', ' / ')}: "
                         f"{r[f'cpu_{pair}']}, median {r[f'median_cpu_{pair}']:.3f}")
    return "\n".join(lines)


def _capacity(result: dict[str, Any]) -> str:
    cap = result["capacity"]
    per = cap["bytes_per_token"]
    lines = [f"{'server':>6} {'kind':>4} {'start s':>8} {'KV tokens':>11} {'max concurrency':>16}"
             f" {'spec acceptance length':>23}"]
    for s in result["servers"]:
        accepted = s.get("acceptance_lengths") or [float("nan")]
        lines.append(f"{s['index']:>6} {s['kind']:>4} {s['start_s']:>8.0f} {s['kv_tokens']:>11,} "
                     f"{s['max_concurrency']:>15.2f}x {min(accepted):>11.2f}-{max(accepted):.2f}")
    lines.append(f"KV tokens on / off: measured {cap['measured_on_over_off']:.4f}; arithmetic "
                 f"{per['attention']:,} / ({per['attention']:,} + {per['states']:,}) = "
                 f"{cap['arithmetic_on_over_off']:.4f} (B/token: K and V of every layer; "
                 f"{per['capture_ids']} captured ids x H)")
    return "\n".join(lines)


def _end_to_end(result: dict[str, Any]) -> str:
    e = result["end_to_end"]
    t = e["tokens"]
    lines = [f"end to end: {t['prompt']:,} prompt + {t['output']:,} output tokens "
             f"(outputs equal on both servers: {t['same_outputs']})",
             f"{'path':<28} {'generate s':>10} {'prepare s':>9} {'start s':>8} "
             f"{'extract s':>9} {'total s':>8} {'disk kB':>9}"]
    rows = [("capture + captured", e["capture"], e["capture"]["extract"]),
            ("no capture + vllm", e["no_capture"], e["no_capture"]["extract"])]
    if "extract_hf" in e["no_capture"]:
        rows.append(("no capture + hf", e["no_capture"], e["no_capture"]["extract_hf"]))
    for name, run, ex in rows:
        total = run["generate_s"] + run["prepare_s"] + ex["start_s"] + ex["run_s"]
        disk = sum(run["bytes"].values()) / 1e3
        lines.append(f"{name:<28} {run['generate_s']:>10.1f} {run['prepare_s']:>9.1f} "
                     f"{ex['start_s']:>8.1f} {ex['run_s']:>9.1f} {total:>8.1f} {disk:>9,.0f}")
    for name, run in (("capture", e["capture"]), ("no capture", e["no_capture"])):
        sizes = ", ".join(f"{k} {v / 1e3:,.0f} kB" for k, v in run["bytes"].items())
        lines.append(f"  {name}: {sizes}")
    return "\n".join(lines)


def _kimi(k: dict[str, Any]) -> str:
    return "\n".join([
        "8 x H200, INT4 Kimi-K2.5, TP 8 (arithmetic, not measured):",
        f"  per token per GPU: MLA 61 x (512 + 64) x 2 B = {k['mla_bytes_per_token']:,} B; "
        f"states {len(k['captured_vllm_ids'])} x 7168 x 2 B = {k['states_bytes_per_token']:,} B",
        f"  KV memory per GPU {k['kv_gb_per_gpu']} GB = {k['kv_gb_per_gpu_arithmetic']}",
        f"  tokens per replica: off {k['tokens_off']:,}, on {k['tokens_on']:,} "
        f"(x{k['on_over_off']}; with an fp8 KV cache x{k['on_over_off_fp8_kv']})",
        f"  requests of {k['tokens_per_request']:,} tokens at once: off {k['requests_off']}, "
        f"on {k['requests_on']}"])
