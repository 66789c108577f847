"""KV connectors for disaggregated prefill/decode (``hitchllm_kv_connectors``)."""
