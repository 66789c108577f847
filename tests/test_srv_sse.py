"""SSE framing: orjson and the json fallback write the same events."""

from __future__ import annotations

import json
import sys

from hitchllm.entrypoints.openai import streaming

PAYLOAD = {"id": "cmpl-1", "choices": [{"index": 0, "text": "héllo \u4e16\u754c \"q\"\n",
                                        "logprobs": None, "finish_reason": None}],
           "usage": {"prompt_tokens": 3}}


def test_sse_frames_a_json_object_and_a_literal():
    event = streaming.sse(PAYLOAD)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:-2]) == PAYLOAD
    assert "\u4e16".encode() in event  # UTF-8 text as it is, not \\u escapes
    assert streaming.sse("[DONE]") == b"data: [DONE]\n\n"


def test_json_fallback_without_orjson_writes_the_same_event(monkeypatch):
    monkeypatch.setitem(sys.modules, "orjson", None)  # import orjson now raises ImportError
    fallback = streaming._json_encoder()
    assert json.loads(fallback(PAYLOAD)) == PAYLOAD
    assert "\u4e16".encode() in fallback(PAYLOAD)
