"""What the state check allows (datagen/extraction/tolerance.py): it follows the dtype the
generation server ran in and the path the states took, not the dtype they are stored in. A
float32 extraction (the hf and vllm backends run a forward of their own) checked against a
bf16 server's log-probabilities passes, and a shift by one position still fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from datagen.extraction import tolerance
from datagen.extraction.backends.base import text_config
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.files import prepare
from datagen.extraction.integrity import StateCheck, StateCheckFailed
from datagen.extraction.tolerance import Tolerance
from datagen.generation.records import pack_logprobs

VOCAB, HIDDEN, LAYERS = 256, 64, 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from datagen.builders.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("m") / "llama", VOCAB,
                            hidden_size=HIDDEN, num_layers=LAYERS)


def bf16_server(model: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Output ids and their log-probabilities as a bf16 server gives them: the tiny model
    run in bfloat16, its logits rounded to bf16 before the log-softmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(sum(prompt))
    output = torch.randint(0, VOCAB, (n,), generator=g).tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    first = len(prompt) - 1
    return output, [float(logp[first + i, t]) for i, t in enumerate(output)]


def float32_states(model: Path, ids: list[int]) -> torch.Tensor:
    """The final post-norm states [n, H] of a float32 forward (what hf and vllm write)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def test_the_rtol_follows_the_server_dtype_and_the_path() -> None:
    bf16 = 2.0 ** -7
    # a float32 file of a bf16 server: the server's rounding, not float32's
    assert Tolerance(torch.bfloat16, "captured").rtol(torch.float32) == bf16
    assert Tolerance(None, "captured").rtol(torch.float32) == 2.0 ** -20  # one engine's own
    assert Tolerance(torch.bfloat16, "recompute").rtol(torch.float32) == 4 * bf16
    assert Tolerance(torch.float32, "recompute", moe=True).rtol(torch.float32) == 0.03
    with pytest.raises(ValueError, match="path='elsewhere'"):
        Tolerance(torch.float32, "elsewhere")


def test_auto_takes_the_checkpoints_dtype_and_moe_from_its_experts(model: Path) -> None:
    config = text_config(str(model))
    assert tolerance.server_dtype("auto", config) == torch.float32  # the tiny model's own
    assert tolerance.server_dtype("bfloat16", config) == torch.bfloat16
    assert tolerance.for_extraction("captured", "auto", config) == Tolerance(
        torch.float32, "captured", False)
    assert tolerance.for_extraction("vllm", "auto", {"n_routed_experts": 8}).moe


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_float32_states_pass_against_a_bf16_server_and_a_shift_fails(
        model: Path, backend: str) -> None:
    # Given: a bf16 server's log-probabilities, and the float32 states of the same ids
    prompt = [1, 5, 9, 11]
    output, lps = bf16_server(model, prompt, 40)
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": prompt, "output_ids": output,
           "output_logprobs": pack_logprobs(lps)}
    sample = prepare(1, rec, 64, "truncate", VOCAB)
    final = float32_states(model, prompt + output)
    config = text_config(str(model))

    # When: checked with the backend's tolerance for a bf16 server (atol 1e-3)
    check = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0,
                                 tolerance.for_extraction(backend, "bfloat16", config))

    # Then: they pass, where the stored dtype's tolerance (float32's) fails them
    assert check.check(sample, final).positions == 40
    stored = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
    with pytest.raises(StateCheckFailed):
        stored.check(sample, final)
    # and the same states one position late fail whatever the path
    with pytest.raises(StateCheckFailed):
        check.check(sample, torch.roll(final, 1, 0))


def test_the_hf_backend_in_float32_checks_against_a_bf16_servers_logprobs(
        model: Path, tmp_path: Path) -> None:
    # Given: two records whose log-probabilities a bf16 server gave
    recs = []
    for idx, prompt in enumerate([[1, 5, 9], [2, 7, 7, 30]]):
        output, lps = bf16_server(model, prompt, 30)
        recs.append({"idx": idx, "id": f"s{idx}", "dataset": "B1", "prompt_ids": prompt,
                     "output_ids": output, "output_logprobs": pack_logprobs(lps)})
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)

    def extract(server_dtype: str) -> list[int]:
        cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / server_dtype),
                               dtype="float32", device="cpu", max_length=64,
                               check_atol_nats=1e-3, check_positions_cpu=0,
                               server_dtype=server_dtype)
        with Extractor(cfg) as ex:
            result = ex.run_shard(shard)
        return sorted(f.idx for f in result.failures)

    # When / Then: told the server ran bf16, every sample passes; taken as the float32
    # checkpoint's own dtype (auto), the bf16 rounding is past float32's tolerance
    assert extract("bfloat16") == []
    assert extract("auto") == [0, 1]
