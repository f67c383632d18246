"""Prompts to token ids with the target's own chat template.

    tokenizer.py              AutoTokenizer from a local folder, custom code included
    tiktoken_tokenization.py  tiktoken-based tokenizers (Kimi-K2.x's kind)
"""
