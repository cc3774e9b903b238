"""Each locustfile's options reach Locust's real parser and come back parsed into its config.

Runs in a subprocess: Locust needs gevent's monkey-patching before anything imports
``ssl``, which pytest has already done in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = r"""
from gevent import monkey; monkey.patch_all()
import dataclasses, json, os, sys
os.environ["RAG_ZIPF"] = "0.25"
from locust import argument_parser
import locustfiles.mooncake, locustfiles.multi_tenant, locustfiles.multi_turn
import locustfiles.rag, locustfiles.shared_prefix
from locustfiles import _common as C, workloads as W

class Env:
    parsed_options = argument_parser.get_parser().parse_args(sys.argv[1:])

out = {name: dataclasses.asdict(C.config_from_options(Env, cls, options)) for name, cls, options in (
    ("sp", W.SharedPrefixConfig, W.SharedPrefix.options), ("rag", W.RagConfig, W.Rag.options),
    ("turn", W.MultiTurnConfig, W.MultiTurn.options), ("tenant", W.MultiTenantConfig, W.MultiTenant.options),
    ("replay", W.ReplayConfig, W.REPLAY_OPTIONS))}
out["common"] = {o.dest: C.option(Env, o.dest) for o in W.COMMON_OPTIONS}
out["sp_text"] = C.option(Env, W.SHARED_PREFIX_TEXT.dest)
print(json.dumps(out))
"""


def test_locustfile_options_parse_into_the_workload_configs():
    args = ["--sp-groups", "5", "--sp-text=true", "--sp-question-tokens", "3-9", "--chat-turns", "2",
            "--ignore-eos", "false", "--trace-loop", "no", "--seed", "7", "--request-timeout", "12"]
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sp"]["groups"] == 5 and out["sp"]["question_tokens"] == [3, 9]
    assert out["sp"]["system_tokens"] == 3072  # untouched: the config's default
    assert out["sp_text"] is True
    assert out["rag"]["zipf_s"] == 0.25  # from the environment variable
    assert out["turn"]["turns"] == [2, 2]
    assert out["replay"]["loop"] is False and out["replay"]["trace_file"].endswith(".jsonl")
    assert out["common"]["ignore_eos"] is False and out["common"]["seed"] == 7
    assert out["common"]["request_timeout"] == 12.0 and out["common"]["think_time"] == 0.0
