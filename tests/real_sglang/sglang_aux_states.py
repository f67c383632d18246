"""Run by .venv-sglang's interpreter (the project's venv has no sglang): one in-process
``sglang.Engine`` on the CPU with aux capture, one request per row of token ids, the prefill's
returned states saved as {"rows": [[L, n*H] float32, ...]} in the columns' asked order.

    python sglang_aux_states.py MODEL_DIR ROWS_JSON OUT_PT DTYPE LAYER_ID...
"""

from __future__ import annotations

import json
import sys

import torch

from datagen.extraction.backends.sglang_engine import (
    aux_capture_kwargs,
    aux_request_ids,
    engine_kwargs,
)


def main(model_dir: str, rows_json: str, out_pt: str, dtype: str, layer_ids: list[int]) -> None:
    import sglang

    rows = json.loads(open(rows_json, encoding="utf-8").read())
    _, columns = aux_request_ids(layer_ids)
    engine = sglang.Engine(**engine_kwargs(model_dir, dtype, False, "cpu", 4096, 0.3),
                           **aux_capture_kwargs(layer_ids))
    try:
        outs = engine.generate(input_ids=rows, return_hidden_states=True,
                               sampling_params={"max_new_tokens": 1, "temperature": 0})
    finally:
        engine.shutdown()
    got = []
    for ids, out in zip(rows, outs, strict=True):
        states = torch.tensor(out["meta_info"]["hidden_states"][0])  # the prefill's [L, n*H]
        parts = states.reshape(len(ids), len(set(layer_ids)), -1)
        got.append(parts[:, columns].reshape(len(ids), -1))
    torch.save({"rows": got}, out_pt)
    print(f"sglang {sglang.__version__}: {len(got)} rows, aux shape {tuple(got[0].shape)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], [int(a) for a in sys.argv[5:]])
