"""hitchllm-quantization: quantized weights and an fp8 KV cache for hitchllm."""
