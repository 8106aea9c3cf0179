"""Runs ``vllm bench serve`` and tandem-loadtest on the same endpoint and the
same prompts, interleaved, and prints both tools' pooled TTFT/ITL medians as
one JSON line. Started as a subprocess by ``test_loadtest.py`` (vllm is heavy
to import and prints noise at exit); usable by hand too:

    python tests/integration/loadtest_vllm_agreement.py --url URL --model NAME --tokenizer DIR

Round k runs vllm bench serve's own ``main`` on N random prompts at
concurrency 1, then tandem-loadtest on N prompts from the same generator
(vLLM's random dataset: same token lengths, other seed); the order flips every
round. Identical prompts would let whichever tool runs second hit the prefix
cache the first one filled. Rounds are short so that drifting machine load (this machine is
shared) hits both tools alike. Rounds continue while the pooled medians
disagree by more than the tolerance, up to ``--max-rounds``: more data
narrows noise but cannot hide a systematic difference.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tandem_loadtest.arrivals import FixedConcurrency
from tandem_loadtest.metrics import request_metrics
from tandem_loadtest.runner import RunConfig, run_load
from tandem_loadtest.tenants import TenantConfig
from tandem_loadtest.workloads import WorkloadOptions


def vllm_args(a: argparse.Namespace, result_dir: Path, seed: int) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "openai-chat", "--base-url", a.url, "--endpoint", "/v1/chat/completions",
        "--model", a.model, "--tokenizer", a.tokenizer, "--dataset-name", "random",
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--num-prompts", str(a.num_prompts), "--max-concurrency", "1", "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
    ])


def write_prompts(args: argparse.Namespace, path: Path) -> None:
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode, trust_remote_code=False)
    with path.open("w") as f:
        for sample in get_samples(args, tokenizer):
            f.write(json.dumps({"prompt": sample.prompt, "output_tokens": sample.expected_output_len}) + "\n")


def run_vllm(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    from vllm.benchmarks.serve import main

    result: dict[str, Any] = main(copy.deepcopy(args))  # main() mutates its args
    ok = [i for i, err in enumerate(result["errors"]) if not err]
    assert len(ok) == args.num_prompts, result["errors"]
    ttfts = [result["ttfts"][i] for i in ok]
    itls = [gap for i in ok for gap in result["itls"][i]]
    return ttfts, itls


def run_ours(a: argparse.Namespace, prompts: Path) -> tuple[list[float], list[float]]:
    config = RunConfig(
        base_url=a.url, model=a.model, arrival=FixedConcurrency(1),
        tenants=[TenantConfig("agreement", os.environ.get("OPENAI_API_KEY"), {"file": 1.0})],
        workload=WorkloadOptions(prompts_file=prompts), num_requests=a.num_prompts,
        ignore_eos=True, temperature=0.0,
    )
    result = asyncio.run(run_load(config))
    metrics = [request_metrics(r) for r in result.records]
    assert all(m is not None for m in metrics), [r.error for r in result.records]
    return [m.ttft_s for m in metrics if m], [g for m in metrics if m for g in m.itl_s]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--num-prompts", type=int, default=4, help="per round")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-rounds", type=int, default=4)
    p.add_argument("--max-rounds", type=int, default=12)
    p.add_argument("--tolerance", type=float, default=0.10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pooled: dict[str, list[float]] = {"vllm_ttft": [], "vllm_itl": [], "ours_ttft": [], "ours_itl": []}
        rounds: list[dict[str, float]] = []
        for k in range(a.max_rounds):
            vargs = vllm_args(a, Path(tmp), seed=a.seed + k)
            prompts = Path(tmp) / f"prompts-{k}.jsonl"
            write_prompts(vllm_args(a, Path(tmp), seed=a.seed + 1000 + k), prompts)
            order = ("vllm", "ours") if k % 2 == 0 else ("ours", "vllm")
            per_round: dict[str, float] = {}
            for tool in order:
                ttfts, itls = run_vllm(vargs) if tool == "vllm" else run_ours(a, prompts)
                pooled[f"{tool}_ttft"] += ttfts
                pooled[f"{tool}_itl"] += itls
                per_round[f"{tool}_ttft_ms"] = 1000 * float(np.median(ttfts))
                per_round[f"{tool}_itl_ms"] = 1000 * float(np.median(itls))
            rounds.append(per_round)
            med = {k2: 1000 * float(np.median(v)) for k2, v in pooled.items()}
            ttft_diff = abs(med["ours_ttft"] / med["vllm_ttft"] - 1)
            itl_diff = abs(med["ours_itl"] / med["vllm_itl"] - 1)
            if k + 1 >= a.min_rounds and max(ttft_diff, itl_diff) <= a.tolerance:
                break
    out = {
        "rounds": rounds,
        "num_rounds": len(rounds),
        "median_ttft_ms": {"vllm": med["vllm_ttft"], "ours": med["ours_ttft"]},
        "median_itl_ms": {"vllm": med["vllm_itl"], "ours": med["ours_itl"]},
        "ttft_rel_diff": ttft_diff,
        "itl_rel_diff": itl_diff,
        "num_samples": {k2: len(v) for k2, v in pooled.items()},
    }
    print("AGREEMENT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
