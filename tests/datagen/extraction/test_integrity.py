"""The state check (datagen/extraction/integrity.py) on the CPU with a real tiny Llama:
each sample's final states give back the log-probabilities the record carries, and a file
whose states are one position off is never trained: the shard reports it as a failure with
the measured gap, its manifest line never appears, and the tallies say what was checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.files import prepare
from datagen.extraction.integrity import StateCheck
from datagen.generation.records import pack_logprobs, unpack_logprobs

VOCAB, HIDDEN, LAYERS = 256, 64, 6
AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from datagen.builders.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("m") / "llama", VOCAB,
                            hidden_size=HIDDEN, num_layers=LAYERS)


def generated(model: Path, prompt: list[int], n: int) -> tuple[list[int], list[float], dict]:
    """Greedy output ids, their log-probabilities and the states of prompt + output[:-1],
    as a capture server would give them (float32, transformers standing in for vLLM)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)[0].tolist()
        ids = out[:-1]
        res = hf(torch.tensor([ids]), output_hidden_states=True)
    output = out[len(prompt):]
    logp = torch.log_softmax(res.logits[0].float(), -1)
    lps = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]
    hs = res.hidden_states
    states = {"input_ids": torch.tensor(ids, dtype=torch.int64),
              "aux_hidden_state": torch.cat([hs[a + 1][0] for a in AUX], -1).contiguous(),
              "hidden_state": hs[-1][0].contiguous()}
    return output, lps, states


def save_captured(path: Path, states: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(states, str(path), {"aux_layer_ids": json.dumps(list(AUX))})


def test_logprobs_pack_into_a_record_compactly_and_back() -> None:
    values = [-0.25, -3.5, -9999.0]
    text = pack_logprobs(values)
    assert unpack_logprobs(text) == values and len(text) == 16
    with pytest.raises(ValueError):
        unpack_logprobs("not base64!")


def test_the_captured_backend_checks_each_file_and_dead_letters_an_off_by_one(
        model: Path, tmp_path: Path) -> None:
    # Given: three captured samples with the server's logprobs; the second's states are
    # planted one position late (the states of position t stored at t + 1)
    run = tmp_path / "run"
    recs = []
    for idx, prompt in enumerate([[1, 5, 9], [2, 7, 7, 30, 4], [3, 100]]):
        output, lps, states = generated(model, prompt, 12)
        if idx == 1:
            states["hidden_state"] = torch.roll(states["hidden_state"], 1, 0).contiguous()
        save_captured(run / "states" / f"r{idx}.safetensors", states)
        recs.append({"idx": idx, "id": f"s{idx}", "dataset": "B1", "prompt_ids": prompt,
                     "output_ids": output, "states": f"states/r{idx}.safetensors",
                     "output_logprobs": pack_logprobs(lps)})
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           aux_layer_ids=AUX, dtype="float32", device="cpu", max_length=64,
                           backend="captured", run_dir=str(run), check_atol_nats=1e-3,
                           check_positions_cpu=5)

    # When: the shard is extracted
    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)

    # Then: the two true files are written, each checked at 5 positions (the CPU's bound);
    # the planted one is a failure naming its gap, and has no file nor manifest line
    assert result.written == 2
    assert [(f.idx, f.reason.split(":")[0]) for f in result.failures] == [(1, "state check")]
    assert "nats at position" in result.failures[0].reason
    assert not (tmp_path / "hs" / "rows_0-2000" / "data_1.ckpt").exists()
    lines = [json.loads(x) for x in
             next((tmp_path / "hs" / "manifest").glob("*.jsonl")).read_text().splitlines()]
    assert sorted(e["idx"] for e in lines) == [0, 2]
    assert all(e["checked"] == 5 and e["gap"] < 1e-3 for e in lines)
    tally = result.check.as_dict()
    assert tally["checked"] == 3 and tally["failed"] == 1 and tally["positions"] == 15
    assert tally["worst_gap"] > 1e-3


def test_the_hf_backend_checks_its_own_states_against_the_record(model: Path,
                                                                  tmp_path: Path) -> None:
    # Given: a record with its logprobs, and one whose logprobs were another sample's
    output, lps, _ = generated(model, [1, 5, 9], 10)
    other, other_lps, _ = generated(model, [4, 4, 4], 10)
    recs = [{"idx": 0, "id": "a", "dataset": "B1", "prompt_ids": [1, 5, 9],
             "output_ids": output, "output_logprobs": pack_logprobs(lps)},
            {"idx": 1, "id": "b", "dataset": "B1", "prompt_ids": [1, 5, 9],
             "output_ids": output, "output_logprobs": pack_logprobs(other_lps)},
            {"idx": 2, "id": "c", "dataset": "B1", "prompt_ids": [4, 4, 4],
             "output_ids": other}]  # no logprobs: written, not checked
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           aux_layer_ids=AUX, dtype="float32", device="cpu", max_length=64,
                           check_atol_nats=1e-3, check_positions_cpu=0)

    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)

    assert result.written == 2 and [f.idx for f in result.failures] == [1]
    assert result.check.as_dict()["checked"] == 2 and result.check.unchecked == 1
    assert result.check.positions == 20  # every position (check_positions_cpu 0)


def test_a_cpu_checks_a_fixed_bounded_subset_of_positions(model: Path) -> None:
    output, lps, states = generated(model, [1, 5, 9], 20)
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": [1, 5, 9],
           "output_ids": output, "states": "x", "output_logprobs": pack_logprobs(lps)}
    sample = prepare(1, rec, 64, "truncate", VOCAB, captured=True)
    cpu = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 4)
    first = cpu.rows(sample, sample.length)
    assert len(first) == 4 and first == cpu.rows(sample, sample.length)  # seeded by the id
    assert cpu.check(sample, states["hidden_state"]).positions == 4
    # the last output id (not an input of the captured row) is checked too
    every = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
    assert [r[1] for r in every.rows(sample, sample.length)] == output
