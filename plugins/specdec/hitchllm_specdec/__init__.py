"""hitchllm-specdec: speculative-decoding proposers for hitchllm."""
