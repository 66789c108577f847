"""Quantize a float checkpoint to an AWQ-format int4 checkpoint by round-to-nearest (RTN).

    python scripts/quantize_awq_rtn.py --model core/hitchllm/default_model \\
        --out /tmp/default-awq --group-size 64 [--agreement tests/data/heldout_stdlib/*.py]

Every projection weight (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``) becomes ``qweight``/``qzeros``/``scales`` in AutoAWQ's GEMM packing
(``hitchllm_quantization.awq_packing``); everything else (embeddings, norms, the LM head) is
copied, and config.json gets ``quantization_config`` with ``quant_method: "awq"``, so hitchllm
(and other AWQ loaders) read the result as an AWQ checkpoint.

This is RTN, not AWQ's algorithm: each group of ``--group-size`` input columns of an output
row maps its ``[min, max]`` range onto 16 levels; there is no calibration data and no
activation-aware per-channel scaling, so its accuracy is a lower bound for what AWQ reaches on
the same model. It exists to produce AWQ checkpoints offline for tests and accuracy numbers.

``--agreement FILE...`` then compares the quantized model with the original on those files:
the share of positions where their greedy next tokens agree (teacher-forced, on every window
of the text), and greedy continuations of prompts cut from the text.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hitchllm_quantization.awq_packing import quantize_rtn
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(model: Path, out: Path, group_size: int) -> int:
    """Write the AWQ checkpoint of ``model`` to ``out``; returns the number of layers
    quantized."""
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model} has no *.safetensors weights to quantize")
    shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors"),
                    dirs_exist_ok=True)
    layers = 0
    for file in files:
        tensors = {}
        for name, tensor in load_file(str(file)).items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
                qweight, qzeros, scales = quantize_rtn(tensor, group_size)
                tensors |= {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros,
                            f"{module}.scales": scales}
                layers += 1
            else:
                tensors[name] = tensor
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return layers


def greedy_agreement(original: str, quantized: str, texts: list[str], window: int,
                     continuations: int = 32) -> dict[str, float]:
    """Teacher-forced top-1 agreement over every ``window``-token window of ``texts``, and
    greedy continuations (``continuations`` tokens) of prompts cut from the text."""
    import torch

    from hitchllm import LLM, SamplingParams

    llms = [LLM(path, dtype="float32") for path in (original, quantized)]
    tokenizer = llms[0].get_tokenizer()
    stream = [t for text in texts for t in tokenizer(text, verbose=False).input_ids]
    windows = [stream[s : s + window] for s in range(0, len(stream) - window, window)]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    tops = []
    for llm in llms:
        outs = llm.generate([{"prompt_token_ids": w} for w in windows], scoring, use_tqdm=False)
        tops.append([max(entry, key=lambda t: entry[t].logprob)
                     for out in outs for entry in out.prompt_logprobs[1:]])
    same = torch.tensor(tops[0]) == torch.tensor(tops[1])
    prompts = [{"prompt_token_ids": w[: window // 2]} for w in windows]
    params = SamplingParams(max_tokens=continuations, min_tokens=continuations, temperature=0.0)
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            for llm in llms]
    prefix = 0
    for a, b in zip(*runs, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return {
        "positions": len(same), "top1_agreement": same.float().mean().item(),
        "continuations": len(prompts),
        "identical_continuations": sum(a == b for a, b in zip(*runs, strict=True)) / len(prompts),
        "tokens_before_first_difference": prefix / (len(prompts) * continuations),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="float checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="where to write the AWQ one")
    parser.add_argument("--group-size", type=int, default=128,
                        help="input columns per scale and zero point (must divide every "
                             "projection's input size; default 128)")
    parser.add_argument("--agreement", type=Path, nargs="+", metavar="FILE",
                        help="text files to compare greedy tokens of the two models on")
    parser.add_argument("--window", type=int, default=256, help="tokens per agreement window")
    args = parser.parse_args()
    layers = quantize_checkpoint(args.model, args.out, args.group_size)
    print(f"wrote {args.out}: {layers} projections quantized to int4, group size "
          f"{args.group_size} (round-to-nearest)")
    if args.agreement:
        texts = [path.read_text(encoding="utf-8") for path in args.agreement]
        result = greedy_agreement(str(args.model), str(args.out), texts, args.window)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
