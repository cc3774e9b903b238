"""The router's hot loops in C, built at install time (metadata is in pyproject.toml).

Plain C against the CPython API, compiled by the system C compiler: the block
index's hash tables (``routing/_blocktable.c``), the policy's score of every
candidate (``routing/_contenders.c``) and the block-key chaining loop
(``routing/_chain.c``, on xxHash's header-only C library: Debian's
``libxxhash-dev``, installed by ``make build-deps``).

``PREFIX_SERVE_SANITIZE=1`` builds both with AddressSanitizer and
UndefinedBehaviorSanitizer (``make test-asan``).
"""

import os
import sysconfig
from pathlib import Path

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
         "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
LINK: list[str] = []
if os.environ.get("PREFIX_SERVE_SANITIZE") == "1":
    SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
    FLAGS = [f for f in FLAGS if f != "-O2"] + ["-O1", "-Werror"] + SANITIZE  # warnings fail this build
    LINK = SANITIZE


def _xxhash_include_dirs() -> list[str]:
    """Where xxhash.h is (XXHASH_INCLUDE_DIR, else the compiler's default paths); a clear error if nowhere."""
    custom = os.environ.get("XXHASH_INCLUDE_DIR")
    candidates = [custom] if custom else []
    candidates += ["/usr/include", "/usr/local/include", sysconfig.get_config_var("INCLUDEDIR") or ""]
    for where in candidates:
        if where and (Path(where) / "xxhash.h").is_file():
            return [] if where in ("/usr/include", "/usr/local/include") else [where]
    raise SystemExit(
        "xxhash.h not found: routing/_chain.c needs xxHash's C library (header-only). "
        "Install it with `make build-deps` (Debian/Ubuntu: apt-get install libxxhash-dev; "
        "macOS: brew install xxhash), or set XXHASH_INCLUDE_DIR to the folder holding xxhash.h."
    )


setup(
    ext_modules=[
        Extension("routing._blocktable", ["routing/_blocktable.c"], depends=["routing/_buffers.h"],
                  extra_compile_args=FLAGS, extra_link_args=LINK),
        Extension("routing._contenders", ["routing/_contenders.c"], extra_compile_args=FLAGS,
                  extra_link_args=LINK),
        Extension("routing._chain", ["routing/_chain.c"], depends=["routing/_buffers.h"],
                  include_dirs=_xxhash_include_dirs(), extra_compile_args=FLAGS, extra_link_args=LINK),
    ]
)
