"""The load of the A/B harness: the warm-up, the working set's size, Locust run headless as a
subprocess, and what Locust leaves behind (its CSV, the per-request samples)."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.ab.common import REPO, log
from locustfiles import workloads as W


def warm_up(base_url: str, model: str, n: int, seed: int) -> dict[str, Any]:
    """``n`` short requests with prompts unrelated to the workload (2 at a time), as text: Ray's
    ``PrefixCacheAffinityRouter`` (rsl_prefix) divides by the prompt's text length and never answers
    a token-id prompt (Ray 2.60: ``ZeroDivisionError`` in ``_prefix_match_best_replicas``)."""
    import httpx

    rng = random.Random(f"warmup:{seed}")
    prompts = [W.words(rng, 36) for _ in range(n)]
    errors: list[str] = []

    def one(prompt):
        try:
            r = httpx.post(f"{base_url}/v1/completions",
                           json={"model": model, "prompt": prompt, "max_tokens": 4}, timeout=120)
            if r.status_code != 200:
                errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as e:
            errors.append(f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, prompts))
    return {"requests": n, "errors": errors, "seconds": round(time.monotonic() - t0, 2)}


def served_model(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/v1/models", timeout=15).json()["data"][0]["id"]


def arg_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in Locust arguments (``--flag v`` or ``--flag=v``), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def kv_capacity(entry: dict[str, Any]) -> int | None:
    """Tokens one engine replica's KV cache holds, when the config pins it (``num_gpu_blocks_override``)."""
    engine = (entry.get("args") or {}).get("engine") or {}
    blocks = engine.get("num_gpu_blocks_override")
    return int(blocks) * int(engine.get("block_size", 16)) if blocks else None


def text_tokens_per_word(model: Path | str, seed: int = 0, n: int = 4096) -> float:
    """Tokens per word of ``workloads.SharedPrefixText``'s prompts under the model's tokenizer
    (``<model>/tokenizer.json`` for a local folder, else the hub id's ``tokenizer.json``): ``n``
    token ids drawn as the workload draws them, written as its words, tokenized as the engine
    tokenizes a text prompt (1.41 on the tiny default model)."""
    from tokenizers import Tokenizer

    rng = random.Random(f"words:{seed}")
    text = W.ids_as_text(W.token_ids(rng, n))
    local = Path(model) / "tokenizer.json"
    # A hub id (the 4090 configs): its tokenizer.json from the hub.
    tokenizer = Tokenizer.from_file(str(local)) if local.exists() else Tokenizer.from_pretrained(str(model))
    return len(tokenizer.encode(text, add_special_tokens=False).ids) / n


def size_workload(base_entry: dict[str, Any], locustfile: Path, locust_args: list[str], factor: float,
                  tokens_per_word: float = 1.0) -> list[str]:
    """Locust arguments that size the shared-system-prompt working set to ``factor``
    times one engine replica's KV cache, when the config pins it
    (``num_gpu_blocks_override`` x ``block_size``) and ``--sp-groups`` is not given.
    ``tokens_per_word``: the tokens of a prompt position, for text prompts (``--sp-text``:
    ``text_tokens_per_word``), 1 for token ids.

    A working set that fits in every replica's cache makes every router look the
    same after warm-up; one that fits the cluster only when each replica keeps to
    its share of the prompts is where routing decides the hit rate.
    """
    groups = W.by_field(W.SharedPrefix.options, "groups")
    system = W.by_field(W.SharedPrefix.options, "system_tokens")
    if factor <= 0 or locustfile.stem != W.SharedPrefix.name or arg_value(locust_args, groups.flag) is not None:
        return []
    engine = (base_entry.get("args") or {}).get("engine") or {}
    blocks = engine.get("num_gpu_blocks_override")
    if not blocks:
        return []
    system_tokens = system.parse(arg_value(locust_args, system.flag) or system.default) * tokens_per_word
    capacity = int(blocks) * int(engine.get("block_size", 16))
    return [f"{groups.flag}={max(2, math.ceil(factor * capacity / system_tokens))}"]


@dataclass
class LoadSpec:
    locustfile: Path
    users: int
    spawn_rate: float
    run_time_s: int
    seed: int
    extra_args: list[str]


def run_locust(spec: LoadSpec, base_url: str, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run Locust headless as a subprocess; CSVs, HTML, samples and log land in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = out_dir / "samples.jsonl"
    samples.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "locust", "-f", str(spec.locustfile), "--headless",
        "-u", str(spec.users), "-r", str(spec.spawn_rate), "-t", f"{spec.run_time_s}s",
        "--host", base_url, "--csv", str(out_dir / "locust"), "--csv-full-history",
        "--html", str(out_dir / "locust.html"), "--only-summary", W.COMMON["seed"].flag, str(spec.seed),
        *spec.extra_args,
    ]
    env = {**os.environ, W.COMMON["samples_file"].env_var: str(samples), W.COMMON["seed"].env_var: str(spec.seed)}
    log(f"locust: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    with open(out_dir / "locust.log", "w", encoding="utf-8") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _CHILDREN.add(proc)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = None
        finally:
            _CHILDREN.discard(proc)
    return {"returncode": rc, "seconds": round(time.monotonic() - t0, 2), "timed_out": rc is None,
            "command": cmd[1:]}


_CHILDREN: set[subprocess.Popen] = set()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except Exception:  # noqa: BLE001
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except Exception:  # noqa: BLE001
            pass


def kill_children() -> None:
    """End every Locust process still running (the watchdog's last resort)."""
    for proc in list(_CHILDREN):
        _kill(proc)


def read_locust_stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def read_samples(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by the end of the run
    return rows
