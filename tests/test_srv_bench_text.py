"""`hitchllm bench serve` times tokens by the text chunks they arrive in: requests whose tokens
decode to no text are left out of the latencies, and said so, instead of counting as 0 ms."""

from __future__ import annotations

import math

from hitchllm.entrypoints.bench_serve import RequestResult, print_table, summarize


def test_requests_without_text_are_left_out_of_latencies_and_reported(capsys):
    timed = RequestResult(ok=True, ttft=0.5, latency=1.5, output_tokens=11,
                          chunk_gaps=[0.1] * 10)
    textless = RequestResult(ok=True, latency=2.0, output_tokens=11)
    summary = summarize([timed, textless, textless], duration=2.0)
    assert summary["textless"] == 2
    assert summary["ttft_p50_ms"] == 500.0  # not 0: the textless ones have no TTFT
    assert math.isclose(summary["tpot_p99_ms"], 100.0)
    assert summary["output_tokens"] == 33
    print_table(summary)
    assert "2 requests streamed tokens but no text" in capsys.readouterr().out


def test_no_warning_when_every_request_streams_text(capsys):
    timed = RequestResult(ok=True, ttft=0.5, latency=1.5, output_tokens=11)
    summary = summarize([timed], duration=1.5)
    print_table(summary)
    assert summary["textless"] == 0 and "no text" not in capsys.readouterr().out
