"""The `sglang` backend's adapter over SpecForge's offline capture, against a stand-in with the
same interface (``set_capture_layers``, ``capture(input_ids=, attention_mask=, loss_mask=)``
returning ``.hidden_states`` [B, L, 3H] and ``.last_hidden_states`` [B, L, H]). The real
capture needs CUDA and SGLang; this checks what the adapter does with what it returns."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from datagen.extraction.backends.sglang import SGLangBackend, text_config
from datagen.extraction.extractor import ExtractionConfig, Extractor

H, LAYERS, VOCAB = 8, 61, 100


class StandInCapture:
    """Fills each token's states with values derived from its id and the layer captured."""

    def __init__(self) -> None:
        self.layers: list[int] | None = None
        self.calls: list[torch.Tensor] = []

    def set_capture_layers(self, layer_ids, *, capture_method: str = "eagle3") -> None:
        self.layers = list(layer_ids)

    def capture(self, *, input_ids, attention_mask, loss_mask):
        assert input_ids.shape == attention_mask.shape == loss_mask.shape
        self.calls.append(input_ids)
        ids = input_ids.float()
        aux = torch.cat([ids.unsqueeze(-1) + layer + torch.zeros(H) for layer in self.layers], -1)
        final = -ids.unsqueeze(-1) + torch.zeros(H)
        return SimpleNamespace(hidden_states=aux, last_hidden_states=final)


def kimi_config() -> dict:
    return {"hidden_size": H, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}


def test_captures_specforge_default_layers_one_request_per_sample() -> None:
    stand_in = StandInCapture()
    backend = SGLangBackend(stand_in, kimi_config(), None, torch.device("cpu"))
    assert stand_in.layers == [1, 29, 57] and backend.width == 4 * H and not backend.packs
    out = torch.empty(5, backend.width)
    backend.forward_row([[3, 4], [7, 8, 9]], out)
    assert [c.tolist() for c in stand_in.calls] == [[[3, 4]], [[7, 8, 9]]]  # never padded
    assert out[:, 0].tolist() == [4, 5, 8, 9, 10]           # id + layer 1
    assert out[:, 2 * H].tolist() == [60, 61, 64, 65, 66]   # id + layer 57
    assert out[:, 3 * H].tolist() == [-3, -4, -7, -8, -9]   # final


def test_a_capture_of_the_wrong_shape_is_an_error() -> None:
    stand_in = StandInCapture()
    backend = SGLangBackend(stand_in, kimi_config(), (1, 2), torch.device("cpu"))  # 2 aux
    stand_in.layers = [1, 2, 3]  # the engine captured 3 layers anyway
    with pytest.raises(RuntimeError, match=r"expected \(2, 16\)"):
        backend.forward_row([[1, 2]], torch.empty(2, backend.width))


def test_extractor_over_the_sglang_adapter_writes_specforge_files(tmp_path: Path) -> None:
    backend = SGLangBackend(StandInCapture(), kimi_config(), None, torch.device("cpu"))
    shard = tmp_path / "shard.jsonl"
    shard.write_text("".join(json.dumps({"idx": i, "id": f"s{i}", "dataset": "d",
                                         "prompt_ids": [1, 2], "output_ids": [i + 3] * 4})
                             + "\n" for i in range(3)))
    cfg = ExtractionConfig(model_path="", output_dir=str(tmp_path / "out"), dtype="float32",
                           backend="sglang")
    with Extractor(cfg, backend=backend) as ex:
        assert ex.pack_tokens == 0
        assert ex.run_shard(shard).written == 3
    data = torch.load(next((tmp_path / "out").rglob("data_2.ckpt")), weights_only=True)
    assert data["aux_hidden_state"].shape == (1, 6, 3 * H)
    assert data["hidden_state"][0, :, 0].tolist() == [-1, -2, -5, -5, -5, -5]
    assert json.loads((tmp_path / "out/extraction.json").read_text())["aux_layer_ids"] == [
        1, 29, 57]


def test_kimi_k25_text_config_is_read_from_the_nested_entry(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k25", "text_config": {"hidden_size": 7168, "num_hidden_layers": 61,
                                                   "vocab_size": 163840}}))
    assert text_config(str(tmp_path))["hidden_size"] == 7168
