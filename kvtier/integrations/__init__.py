"""Engines plugging into kvtier (issue 15): `vllm.py`, a vLLM KV connector; `paged.py`, the
copies between an engine's paged KV and kvtier's `[layers, 2, tokens, heads, head_dim]`.

Only the engine's own module imports the engine: `import kvtier` never needs vLLM or SGLang.
"""
