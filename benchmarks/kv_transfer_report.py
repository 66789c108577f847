"""Per-request KV-transfer figures of a disaggregated run, from the instances' /metrics.

    python benchmarks/kv_transfer_report.py --producer URL --consumer URL [--results FILE]

Reads the consumer's ``hitchllm:kv_transfer_load_*`` counters (loads, bytes, seconds from
the start of a load until its KV arrived, failures, fallbacks) and the producer's
``kv_transfer_save_*`` ones, prints the mean transfer time and bytes per request, and appends
the line to ``--results`` (benchmarks/disagg_serve_gpu.sh does). Bytes are tensor-parallel
rank 0's share.
"""

from __future__ import annotations

import argparse
import urllib.request
from pathlib import Path


def scrape(url: str) -> dict[str, float]:
    """Every ``hitchllm:`` sample of ``url``'s /metrics, summed over its labels."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=10) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hitchllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def report(producer: dict[str, float], consumer: dict[str, float]) -> str:
    def get(metrics: dict[str, float], name: str) -> float:
        return metrics.get(f"hitchllm:kv_transfer_{name}_total", 0.0)

    loads = get(consumer, "loads")
    saves = get(producer, "saves")
    per_load_ms = 1000 * get(consumer, "load_seconds") / loads if loads else float("nan")
    per_save_ms = 1000 * get(producer, "save_seconds") / saves if saves else float("nan")
    mib = get(consumer, "load_bytes") / loads / 2**20 if loads else float("nan")
    return (f"KV transfer: {loads:.0f} loads, {per_load_ms:.1f} ms per request from the start "
            f"of the load until the KV arrived (producer: {per_save_ms:.1f} ms per save), "
            f"{mib:.2f} MiB per request, {get(consumer, 'load_bytes') / 2**30:.2f} GiB in all; "
            f"{get(consumer, 'failed_loads'):.0f} failed, {get(consumer, 'load_fallbacks'):.0f} "
            "requests computed their prompt on the decode instance; prompt tokens computed "
            f"there: {consumer.get('hitchllm:prompt_tokens_computed_total', 0):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producer", required=True, help="base URL of the prefill instance")
    parser.add_argument("--consumer", required=True, help="base URL of the decode instance")
    parser.add_argument("--results", type=Path, help="append the line to this file")
    args = parser.parse_args()
    line = report(scrape(args.producer), scrape(args.consumer))
    print(line)
    if args.results:
        with args.results.open("a") as f:
            f.write(f"\n{line}\n")


if __name__ == "__main__":
    main()
