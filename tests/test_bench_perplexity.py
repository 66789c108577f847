"""`hitchllm bench perplexity` scores text through the engine's prompt logprobs; its loss equals
transformers' cross-entropy on the same windows."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from reference import hf_model
from transformers import AutoTokenizer

from hitchllm.entrypoints.bench_perplexity import token_windows
from hitchllm.entrypoints.cli import main

TEXTS = [
    "def add(a, b):\n    return a + b\n\nclass Engine:\n    def step(self):\n        pass\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    print(os.getcwd(), sys.argv)\n",
]


@pytest.mark.parametrize("length,max_len", [(2, 2), (5, 3), (6, 3), (40, 16), (10, 64)])
def test_windows_score_every_token_once(length, max_len):
    windows = token_windows(list(range(length)), max_len)
    scored = [t for w in windows for t in w[1:]]
    assert scored == list(range(1, length))
    assert all(2 <= len(w) <= max_len for w in windows)
    # Each window after the first starts with the previous window's last token (its context).
    assert all(a[-1] == b[0] for a, b in itertools.pairwise(windows))


def hf_loss(path: str, texts: list[str], max_len: int) -> tuple[float, int]:
    """Mean nats per token from transformers' logits on the same windows, and the count."""
    tok = AutoTokenizer.from_pretrained(path)
    stream = [t for text in texts for t in tok(text).input_ids]
    model = hf_model(path)
    nats, count, start = 0.0, 0, 0
    while start < len(stream) - 1:
        window = torch.tensor([stream[start : start + max_len]])
        with torch.no_grad():
            logits = model(window).logits[0, :-1].double()
        nats += F.cross_entropy(logits, window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
        start += max_len - 1
    return nats / count, count


def test_bench_perplexity_matches_transformers(llama_path, tmp_path, capsys):
    files = []
    for i, text in enumerate(TEXTS):
        files.append(tmp_path / f"doc{i}.py")
        files[-1].write_text(text)
    assert main(["bench", "perplexity", "--model", llama_path, "--max-len", "16",
                 "--text", *map(str, files)]) == 0
    out = capsys.readouterr().out
    loss = float(re.search(r"^loss=(\d+\.\d{4})$", out, re.MULTILINE).group(1))
    ref, count = hf_loss(llama_path, TEXTS, 16)
    assert count > 3 * 15  # several windows, the last one partial
    assert loss == pytest.approx(ref, abs=1e-4)
    row = next(line for line in out.splitlines() if line.startswith("| 2 |")).split("|")
    tokens, nbytes = int(row[2]), int(row[3])
    assert tokens == count and nbytes == sum(len(t.encode()) for t in TEXTS)
    assert float(row[6]) == pytest.approx(ref * tokens / math.log(2) / nbytes, abs=1e-3)


def test_bench_perplexity_rejects_a_window_longer_than_the_model(llama_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXTS[0])
    assert main(["bench", "perplexity", "--model", llama_path, "--max-len", "100000",
                 "--text", str(text)]) == 2
    assert "exceeds max_model_len" in capsys.readouterr().err
