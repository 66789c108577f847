"""hitchllm-structured-output: constrain outputs to a JSON schema, a regex, a choice or a
grammar, enforced as a token bitmask through hitchllm's logits-processor seam."""
