"""The aux layer states the `sglang` backend stores, computed by SGLang 0.5.23's own model
code (``set_eagle3_layers_to_capture`` through ``sglang.Engine``'s aux capture, on the CPU),
against the `hf` backend's ``data_{idx}.ckpt`` files for the same ids and aux layer ids.

Both run float16. Tolerance: SGLang's CPU path (torch-native RMSNorm, its own attention and
fused gate/up projection) rounds in other places than transformers' sdpa forward, and each
float16 rounding is up to 2**-11 (4.9e-4) relative. Measured here: 0.8e-4 to 5.7e-4 of the
states' mean magnitude per layer; the tolerance is 5e-3, ten float16 roundings, and stays far
under the difference between two neighbouring layers (0.47 to 0.58), so an off-by-one layer
index (SGLang captures layer i's output as layer i+1's input) or unordered columns fail it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from sglang_fixture import skip_or_fail

from cli import sglang
from cli.stack import REPO
from datagen.extraction.backends.sglang_engine import aux_request_ids
from datagen.extraction.extractor import ExtractionConfig, Extractor

DRIVER = Path(__file__).resolve().parent / "sglang_aux_states.py"
AUX_IDS = (2, 0, 1)   # not in layer order: SGLang answers in layer order, the files do not
TOLERANCE = 5e-3      # mean |sglang - hf| / mean |hf|, per aux layer (see the docstring)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().mean() / b.abs().mean())


def rows(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 9, 64, 21)]


def hf_files(model_dir: Path, out: Path, id_rows: list[list[int]]) -> list[dict]:
    shard = out / "shard.jsonl"
    shard.parent.mkdir(parents=True)
    shard.write_text("".join(json.dumps({"idx": i, "id": f"s{i}", "prompt_ids": ids[:4],
                                         "output_ids": ids[4:]}) + "\n"
                             for i, ids in enumerate(id_rows)))
    cfg = ExtractionConfig(model_path=str(model_dir), output_dir=str(out / "files"),
                           aux_layer_ids=AUX_IDS, dtype="float16", device="cpu")
    with Extractor(cfg) as ex:
        assert ex.run_shard(shard).written == len(id_rows)
    return [torch.load(next((out / "files").rglob(f"data_{i}.ckpt")), weights_only=True)
            for i in range(len(id_rows))]


def sglang_aux(model_dir: Path, where: Path, id_rows: list[list[int]]) -> list[torch.Tensor]:
    (where / "rows.json").write_text(json.dumps(id_rows))
    env = sglang.cpu_env()
    env["PYTHONPATH"] = f"{REPO}:{env['PYTHONPATH']}"
    argv = [str(sglang.sglang_python()), str(DRIVER), str(model_dir), str(where / "rows.json"),
            str(where / "sglang.pt"), "float16", *map(str, AUX_IDS)]
    done = subprocess.run(argv, env=env, cwd=where, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(where / "sglang.pt", weights_only=True)["rows"]


def test_sglang_engine_aux_states_equal_the_hf_backend_files(tmp_path: Path) -> None:
    reason = sglang.unavailable_reason()
    if reason:
        skip_or_fail(reason)
    # Given: the tiny Llama (4 layers, H=64) and 4 samples of different lengths
    model_dir = sglang.build_model(tmp_path / "model")
    id_rows = rows(4096)
    # When: the hf backend writes its files, and SGLang's engine captures the same layers
    files = hf_files(model_dir, tmp_path / "hf", id_rows)
    got = sglang_aux(model_dir, tmp_path, id_rows)
    # Then: the same ids, and every aux layer's states equal within float16 rounding
    hidden = 64
    for ids, ckpt, aux in zip(id_rows, files, got, strict=True):
        assert ckpt["input_ids"].tolist() == ids
        ref = ckpt["aux_hidden_state"][0]
        assert tuple(aux.shape) == tuple(ref.shape) == (len(ids), len(AUX_IDS) * hidden)
        for k in range(len(AUX_IDS)):
            cols = slice(k * hidden, (k + 1) * hidden)
            assert rel_diff(aux[:, cols], ref[:, cols]) < TOLERANCE, (k, AUX_IDS[k])
    # and the check tells layers apart: neighbouring layers differ far beyond the tolerance
    ref = files[0]["aux_hidden_state"][0]
    assert rel_diff(got[0][:, hidden:2 * hidden], ref[:, 2 * hidden:]) > 10 * TOLERANCE


def test_aux_request_ids_are_distinct_in_layer_order_with_each_asked_ids_column() -> None:
    assert aux_request_ids((2, 0, 1)) == ([0, 1, 2], [2, 0, 1])
    assert aux_request_ids((1, 1, 0)) == ([0, 1], [1, 1, 0])  # the 4-layer default repeats
