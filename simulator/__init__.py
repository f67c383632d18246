"""A stand-in for an SGLang server (``--kind vllm``: a vLLM one): its HTTP API on a simulated
GPU.

Tests, the demo and benchmarks run it instead of a real server: `python -m simulator` or
`simulator.server.start_in_thread(SimulatorConfig(...))`. Outputs are seeded and repeatable;
`/_sim/` endpoints expose a request log, counters and fault injection.
"""
