"""hitchllm: an LLM inference and serving engine, a small core plus plugins."""
