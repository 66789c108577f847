"""Loading a checkpoint's tokenizer without loading its model configuration.

``AutoTokenizer.from_pretrained`` builds the model's transformers configuration only to choose
the tokenizer class, and in transformers 5 importing a configuration class such as
``LlamaConfig`` pulls in ``torch.distributed.tensor`` and sympy (``AutoTokenizer``'s own
module costs more again): about 1.3 s of the bundled model's start-up on a 2-core CPU.

For a local checkpoint that names the generic fast tokenizer (``PreTrainedTokenizerFast`` or
``TokenizersBackend``, as tokenizers trained with the ``tokenizers`` library are saved),
``AutoTokenizer`` ends up loading that generic class (``TokenizersBackend``, alias
``PreTrainedTokenizerFast``) from the checkpoint's files, whatever its configuration holds,
unless transformers overrides the checkpoint's class for its model type: it does so for the
types it lists as naming a wrong class on the Hub whose registered tokenizer is a class of
their own (Qwen2's, for one), not for Llama, Mistral, Qwen3 or DeepSeek; and with
mistral-common installed it loads a checkpoint that ships ``tekken.json`` as Mistral's own.
For the others ``load_tokenizer`` loads the generic class directly. Everything else (hub
names, remote code, Qwen2, tekken checkpoints) goes through ``AutoTokenizer``. With
transformers 5.17 (the H100 machine's) the ``AutoTokenizer`` route also imports scikit-learn,
sympy, Dynamo and the distributed tensors: 3.3 s against 0.3 s for the direct one on a 2-core
CPU (docs/performance.md, start-up).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The class names tokenizer_config.json gives a generic tokenizers-library tokenizer.
GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Model types for which AutoTokenizer honours a generic tokenizer_class as it stands: those
# transformers registers no tokenizer class of its own for (or the generic one), and those
# whose own class it applies only to checkpoints of the types it lists as naming a wrong class
# (Qwen2 is listed, Qwen3 is not). tests/test_cpus_startup.py checks this against
# transformers' own tables and against AutoTokenizer itself.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3"}
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
    if not all(f.is_file() for f in files) or (directory / "tekken.json").exists():
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
            # AutoTokenizer also checks a configuration's model_name against its list.
            and "model_name" not in model_config
            and model_config.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES)
