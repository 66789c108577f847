"""Outputs cross the replica pipe as deltas: decoding rebuilds exactly the engine's cumulative
outputs, step by step, and sends far less than the whole outputs would."""

from __future__ import annotations

import pickle

from hitchllm.config import EngineConfig
from hitchllm.data_parallel.deltas import OutputDecoder, OutputEncoder
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.outputs import CompletionOutput, RequestOutput
from hitchllm.sampling_params import SamplingParams


def test_decoded_outputs_equal_the_engines_at_every_step(llama_path):
    engine = LLMEngine(EngineConfig(model=llama_path, block_size=4, max_model_len=256))
    engine.add_request("def f(x):", SamplingParams(max_tokens=40, ignore_eos=True,
                                                  logprobs=2, prompt_logprobs=1), "lp")
    engine.add_request("x = 1", SamplingParams(max_tokens=30, ignore_eos=True, n=2,
                                              temperature=1.0, seed=3), "n2")
    # A stop string cuts the text back when it completes (the text sent before held its
    # start); the decoder must follow.
    probe = LLMEngine(engine.config)
    probe.add_request("y", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0), "p")
    while probe.has_unfinished_requests():
        for out in probe.step():
            text = out.outputs[0].text
    stop = text[5:8]
    engine.add_request("y", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0,
                                           stop=[stop]), "stop")
    engine.add_request("def g(y):", SamplingParams(max_tokens=20, ignore_eos=True), "plain")
    encoder, decoder = OutputEncoder(), OutputDecoder()
    whole = sent = 0
    finished = set()
    grown: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = encoder.encode(out)
            if type(delta) is tuple:  # a GrowDelta: the common case's 3-tuple
                grown[out.request_id] = grown.get(out.request_id, 0) + 1
            wire = pickle.dumps(delta)
            assert decoder.decode(pickle.loads(wire)) == out
            whole += len(pickle.dumps(out))
            sent += len(wire)
            if out.finished:
                finished.add(out.request_id)
    assert finished == {"lp", "n2", "stop", "plain"}
    # One sequence without logprobs grows by a tuple until its last (finished) output; the
    # others (logprobs, n=2) never do.
    assert grown["plain"] == 18 and set(grown) <= {"plain", "stop"}
    assert encoder._last == {} and decoder._last == {}  # finished requests are forgotten
    assert sent < whole / 2


def test_a_text_that_shrinks_or_changes_is_sent_whole():
    def out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", "p", [1, 2], [CompletionOutput(0, text, ids)], finished)

    encoder, decoder = OutputEncoder(), OutputDecoder()
    for step in (out("abc", [1]), out("abcdef", [1, 2]), out("abXd", [1, 2, 3]),
                 out("ab", [7, 8], finished=True)):
        delta = encoder.encode(step)
        assert decoder.decode(delta) == step
    assert delta.sequences[0].text_keep == 0 and delta.sequences[0].tokens_keep == 0


def test_a_grown_output_with_another_change_is_sent_whole():
    """Only text and token ids growing, nothing else changing, crosses as a GrowDelta."""
    prompt = [1, 2]

    def out(text: str, ids: list[int], cached: int = 0, **seq: object) -> RequestOutput:
        return RequestOutput("r", "p", prompt, [CompletionOutput(0, text, ids, **seq)],
                             num_cached_tokens=cached, metrics={"arrival_time": 1.0})

    encoder, decoder = OutputEncoder(), OutputDecoder()
    steps = [(out("a", [1]), False), (out("ab", [1, 2]), True),
             (out("abc", [1, 2, 3], cached=4), False),  # cached tokens changed
             (out("abcd", [1, 2, 3, 4], cached=4), True),
             (out("abcde", [1, 2, 3, 5, 6], cached=4), False),  # a token id changed
             (out("abcdef", [1, 2, 3, 5, 6, 7], cached=4, cumulative_logprob=-1.0), False)]
    for step, is_grown in steps:
        delta = encoder.encode(step)
        assert (type(delta) is tuple) == is_grown
        assert decoder.decode(pickle.loads(pickle.dumps(delta))) == step
