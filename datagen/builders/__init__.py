"""Builders of the small stand-ins the demo and the tests run on; nothing is downloaded.

    tiny_model.py        a tiny random Llama folder (config, weights, tokenizer, chat template)
    tiny_deepseek.py     a tiny random DeepseekV3 (MLA + MoE), the real target's kind
    tiktoken_fixture.py  a custom-code tiktoken tokenizer folder of Kimi-K2.5's structure
"""
