"""What every part of the A/B harness shares: the repository root, the loopback address, the log."""

from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
LOOPBACK = "127.0.0.1"


def log(msg: str) -> None:
    print(f"[ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)
