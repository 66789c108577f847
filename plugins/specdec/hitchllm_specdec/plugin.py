"""The plugin's hook: the proposers it provides, imported when an engine asks for speculative
decoding."""

from __future__ import annotations

import importlib

from hitchllm import hookimpl
from hitchllm.speculative import Proposer

# method name -> "module:class" inside this package. The engine calls the hook only when
# speculative_method is set, so loading the plugin (every engine start) imports no proposer.
PROPOSERS = {
    "ngram": "ngram:NgramProposer",
    "eagle": "eagle:EagleProposer",
    "draft_model": "draft_model:DraftModelProposer",
}


def load_proposer(name: str) -> type[Proposer]:
    """The proposer class registered under ``name``."""
    module, cls = PROPOSERS[name].split(":")
    return getattr(importlib.import_module(f"hitchllm_specdec.{module}"), cls)


@hookimpl
def hitchllm_speculative_proposers() -> dict[str, type[Proposer]]:
    """``ngram``: prompt lookup; ``draft_model``: a smaller model of the same vocabulary
    (``speculative_model``); ``eagle``: an EAGLE-style head (``speculative_model``)."""
    return {name: load_proposer(name) for name in PROPOSERS}
