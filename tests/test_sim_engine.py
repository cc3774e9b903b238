"""The simulated replica against a real vLLM CPU engine: same requests, same cached tokens.

Runs ``python -m bench.sim.engine_check`` in a child process (vLLM starts its
engine core with multiprocessing spawn; keeping it out of the test process
keeps its threads and memory out too): the foundation issue's 512-token-prefix
table and a sequence that forces evictions on a 64-block KV cache, on the tiny
model, compared request by request with the simulator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-qwen2"

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def check():
    if not (MODEL / "config.json").exists():
        pytest.skip("tiny model not built: python -m infra.tiny_model --out models/tiny-qwen2")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sim.engine_check", "--model", str(MODEL)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{"))
    return json.loads(line)


def test_prefix_table_matches_the_engine(check):
    assert check["prompt_tokens"]["prefix_table"] == 4296
    assert sum(check["engine"]["prefix_table"]) == 3584
    assert check["simulated"]["prefix_table"] == check["engine"]["prefix_table"]


def test_eviction_sequence_matches_the_engine(check):
    assert check["sim_stats"]["evictions"]["evictions"] > 0  # the case really evicts
    engine = check["engine"]["evictions"]
    assert any(0 < c for c in engine)  # and still hits
    assert check["simulated"]["evictions"] == engine
