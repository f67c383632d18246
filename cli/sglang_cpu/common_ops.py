# An empty stand-in for sgl_kernel.common_ops, the CUDA ops library of PyPI's sglang-kernel.
# It exists only so that SGLang imports on a CPU-only machine (the tests and
# `make demo SERVER=sglang`; see cli/sglang.py), where SGLang then falls back to torch-native
# ops. It holds no code on purpose: nothing may call into it. Never put it on a GPU host's path.
