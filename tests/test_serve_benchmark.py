"""benchmarks/serve.py on CPU with the tiny preset: Engine.generate, then the server in its own process under
streaming clients, on the same requests; the server's texts are generate's, and the JSON and table carry
the figures the GPU run reports. Needs the [serve] extra and httpx; CI installs them."""

import json
import os
import subprocess
import sys

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")

from tests.conftest import ROOT  # noqa: E402


def test_the_serve_benchmark_gives_generates_texts_and_its_figures(tmp_path):
    out = tmp_path / "serve.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--preset", "tiny", "--device", "cpu",
                             "--threads", "1", "--num-requests", "8", "--concurrency", "2",
                             "--prompt-len", "16", "--max-tokens", "8", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stderr[-2000:]
    generate, served = json.loads(out.read_text())["rows"]
    assert generate["output_tokens"] == served["output_tokens"] == 8 * 8
    assert served["same_text_as_generate"] == 8
    assert 0 < served["ttft_p50_ms"] <= served["ttft_p99_ms"] and served["ratio_to_generate"] > 0
    assert "| server, 2 streaming clients |" in out.with_suffix(".md").read_text()
