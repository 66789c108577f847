"""Loading a checkpoint's tokenizer without loading its model configuration.

``AutoTokenizer.from_pretrained`` builds the model's transformers configuration only to choose
the tokenizer class, and in transformers 5 importing a configuration class such as
``LlamaConfig`` pulls in ``torch.distributed.tensor`` and sympy (``AutoTokenizer``'s own
module costs more again): about 1.3 s of the bundled model's start-up on a 2-core CPU.

For a local checkpoint that names the generic fast tokenizer (``PreTrainedTokenizerFast`` or
``TokenizersBackend``, as tokenizers trained with the ``tokenizers`` library are saved) for a
model type that transformers maps to no tokenizer of its own, ``AutoTokenizer`` ends up
loading that generic class (``TokenizersBackend``, alias ``PreTrainedTokenizerFast``) from the
checkpoint's files, whatever its configuration holds; ``load_tokenizer`` loads it directly.
Everything else (hub names, remote code, model types with a tokenizer class of their own, such
as Qwen2's) goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The class names tokenizer_config.json gives a generic tokenizers-library tokenizer.
GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Model types for which transformers registers no tokenizer class of its own (or the generic
# one), so that AutoTokenizer honours a generic tokenizer_class as it stands.
# tests/test_cpus_startup.py checks this against transformers' own tables.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "deepseek_v2", "deepseek_v3"}
)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the checkpoint (or tokenizer directory, or hub name) ``path``, the same
    one ``transformers.AutoTokenizer.from_pretrained(path)`` returns."""
    if loads_generic_tokenizer(Path(path)):
        # transformers 5's name for its TokenizersBackend, 4's for the same generic class.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), _from_auto=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def loads_generic_tokenizer(directory: Path) -> bool:
    """Whether ``AutoTokenizer`` would load ``directory``'s tokenizer as the generic
    ``TokenizersBackend`` without looking further than its JSON files."""
    files = [directory / name for name in ("tokenizer.json", "tokenizer_config.json",
                                           "config.json")]
    if not all(f.is_file() for f in files):
        return False
    try:
        tokenizer_config = json.loads(files[1].read_text())
        model_config = json.loads(files[2].read_text())
    except (OSError, ValueError):
        return False  # AutoTokenizer reports what is wrong with the files
    if not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict):
        return False
    return (tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in tokenizer_config and "auto_map" not in model_config
            and model_config.get("tokenizer_class") in (None, *GENERIC_TOKENIZER_CLASSES)
            and model_config.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES)
