"""Capture on the real vLLM 0.32 CPU build, model by model: the tiny Llama, a tiny DeepseekV3
(MLA + MoE) and the Kimi-K2.5 layout (KimiK25ForConditionalGeneration around the same
DeepseekV3 text weights). For each: capture does not change the greedy outputs, the captured
states equal a separate transformers prefill of the same ids, and every file passes the state
check against the server's own log-probabilities, which a planted off-by-one fails.

Servers, one at a time (2 cores): first a plain DeepseekV3 server (capture off: no
speculative config, no connector), whose greedy outputs are the reference for both MoE
layouts (same weights); then one capture server per layout, started with exactly the flags
``datagen.servers.capture.server_args`` gives (the Kimi layout's include
``--limit-mm-per-prompt``), float32 (float16 is refused on DeepSeek/Kimi: vLLM divides their
residual stream). The Llama's capture-off reference is transformers' greedy choice at each
position, equal to vLLM's in float32 (tests/real_vllm/test_vllm_server.py).

Tolerances: Llama states within 1e-4 of transformers' (float32: measured ~1e-6); DeepseekV3
and Kimi within 3% relative Frobenius norm (vLLM's MLA runs the absorbed latent form, and a
router score's rounding can move a token to another expert: measured 0.4-1.6% in
test_vllm_backend.py). The state check: check_atol_nats 1e-3 (float32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_fixture import GenerationServer, start_generation_server, vllm_python

from datagen.client import SGLangClient, new_rid
from datagen.extraction.files import Sample
from datagen.extraction.integrity import StateCheck, StateCheckFailed
from datagen.servers import capture

pytestmark = [pytest.mark.timeout(1800), pytest.mark.usefixtures("cpu_hog_module")]

VOCAB, HIDDEN, LAYERS, CONTEXT = 512, 128, 8, 512
AUX = (1, 3, 4)  # SpecForge's default for 8 layers
PROMPTS = [[1, 4, 17, 99, 250, 7, 8, 9], [3, 300, 41, 5], [2, 77, 78, 79, 80, 81, 90, 11, 12]]
NEW_TOKENS = 10
LAYOUTS = ("llama", "deepseek_v3", "kimi_k25")
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout's engine checkpoint, and the folder transformers reads for it."""
    from datagen.builders.tiny_deepseek import build_tiny_deepseek_v3
    from datagen.builders.tiny_kimi import build_tiny_kimi_k25
    from datagen.builders.tiny_model import build_tiny_llama

    vllm_python()  # skip (or fail in CI) before building anything
    root = tmp_path_factory.mktemp("models")
    kimi = build_tiny_kimi_k25(root / "kimi", VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
    return {"llama": build_tiny_llama(root / "llama", VOCAB, hidden_size=HIDDEN,
                                      num_layers=LAYERS, heads=2),
            "deepseek_v3": build_tiny_deepseek_v3(root / "dsv3", VOCAB, hidden_size=HIDDEN,
                                                  num_layers=LAYERS, for_vllm=True),
            "kimi_k25": kimi, "kimi_k25/text": kimi / "text-backbone"}


def greedy(server: GenerationServer, prompt: list[int], path: Path | None = None
           ) -> Any:
    extra = {"kv_transfer_params": capture.request_params(path)} if path else None
    return SGLangClient(server.url, kind="vllm").generate(
        prompt, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        new_rid("m"), extra=extra, logprobs=True)


@pytest.fixture(scope="module")
def moe_reference(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[int, list[int]]:
    """Capture off: a plain vLLM server's greedy outputs on the DeepseekV3 weights."""
    started = time.monotonic()
    server = start_generation_server(models["deepseek_v3"],
                                     tmp_path_factory.mktemp("logs") / "plain.log", CONTEXT)
    try:
        out = {i: greedy(server, p).output_ids for i, p in enumerate(PROMPTS)}
    finally:
        server.stop()
    TIMES["plain deepseek_v3"] = time.monotonic() - started
    return out


@pytest.fixture(scope="module", params=LAYOUTS)
def captured(request: pytest.FixtureRequest, models: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list]]:
    """One capture server per layout: each prompt generated with capture on; (layout,
    [(prompt, Generation, file)])."""
    layout = request.param
    started = time.monotonic()
    run_dir = tmp_path_factory.mktemp(f"run-{layout}")
    args = capture.server_args(str(models[layout]), run_dir, "float32", AUX)
    server = start_generation_server(models[layout],
                                     tmp_path_factory.mktemp("logs") / f"{layout}.log",
                                     CONTEXT, extra_args=args)
    try:
        samples = []
        for prompt in PROMPTS:
            path = capture.states_path(run_dir, layout, new_rid(layout))
            gen = greedy(server, prompt, path)
            assert capture.wait_released(path, 120)
            samples.append((prompt, gen, path))
    finally:
        server.stop()
    TIMES[f"capture {layout}"] = time.monotonic() - started
    print(f"FIGURE server times so far (s): {TIMES}")
    yield layout, samples


def transformers_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def as_sample(prompt: list[int], gen: Any) -> Sample:
    """The captured row as extraction prepares it (the last output id not an input)."""
    ids = prompt + gen.output_ids[:-1]
    return Sample(0, f"s{len(prompt)}", "d", ids, len(prompt), False, (), "f",
                  (gen.output_ids[-1],), tuple(gen.logprobs))


def test_capture_keeps_greedy_outputs_and_states_equal_a_separate_prefill(
        captured: tuple[str, list], models: dict[str, Path],
        moe_reference: dict[int, list[int]]) -> None:
    from safetensors.torch import load_file

    layout, samples = captured
    hf = transformers_model(models["kimi_k25/text" if layout == "kimi_k25" else layout])
    worst: dict[str, float] = {}
    for i, (prompt, gen, path) in enumerate(samples):
        ids = prompt + gen.output_ids[:-1]
        with torch.no_grad():
            res = hf(torch.tensor([prompt + gen.output_ids]), output_hidden_states=True)
        if layout == "llama":
            # capture on gives capture off's greedy outputs: each is transformers' argmax
            # after the ones before it (greedy by induction; EOS is not masked, as vLLM's
            # ignore_eos does not mask it either)
            argmax = res.logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
            assert gen.output_ids == argmax
        else:
            assert gen.output_ids == moe_reference[i]
        # the file: prompt + output minus its last id, the run's aux layers
        assert capture.check_file(path, ids, list(AUX)) == path.stat().st_size
        got = load_file(str(path))
        hs = [h[:, :len(ids)] for h in res.hidden_states]  # causal: ids' states as a prefill's
        want = {"aux_hidden_state": torch.cat([hs[a + 1][0] for a in AUX], dim=-1),
                "hidden_state": hs[-1][0]}
        for key, ref_states in want.items():
            assert got[key].shape == ref_states.shape
            rel = float((got[key] - ref_states).norm() / ref_states.norm())
            worst[key] = max(worst.get(key, 0.0), rel)
            if layout == "llama":
                torch.testing.assert_close(got[key], ref_states, atol=1e-4, rtol=1e-4)
            else:
                assert rel < 0.03, (key, rel)
    print(f"FIGURE {layout}: captured vs transformers prefill, relative Frobenius {worst}")


def test_every_captured_file_gives_the_server_s_logprobs_and_a_shifted_one_does_not(
        captured: tuple[str, list], models: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    layout, samples = captured
    check = StateCheck.for_model(str(models[layout]), torch.device("cpu"), 1e-3, 0)
    gaps, shifted = [], []
    for prompt, gen, path in samples:
        sample, final = as_sample(prompt, gen), load_file(str(path))["hidden_state"]
        result = check.check(sample, final)
        assert result.positions == NEW_TOKENS
        gaps.append(result.gap)
        # the states one position late (as vLLM #56417 leaves them) or early
        for planted in (torch.roll(final, 1, 0), torch.roll(final, -1, 0)):
            with pytest.raises(StateCheckFailed, match="nats at position") as failed:
                check.check(sample, planted)
            shifted.append(failed.value.result.gap)
    print(f"FIGURE {layout}: state check gap (float32) max {max(gaps):.2e}; off-by-one "
          f"gaps min {min(shifted):.3f}")
