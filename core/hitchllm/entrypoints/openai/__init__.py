"""The OpenAI-compatible server (``hitchllm serve``); needs ``pip install hitchllm[serve]``."""
