"""The KV event wire formats of vLLM and SGLang, as their sources define them, and a
publisher that speaks their ZMQ framing (README.md: the versions read)."""
