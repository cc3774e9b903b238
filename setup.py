"""The router's hot loops in C, built at install time (metadata is in pyproject.toml).

Plain C against the CPython API, compiled by the system C compiler, no other
library: the block index's hash table (``routing/_blocktable.c``) and the
block-key chaining loop (``routing/_chain.c``; the hashing stays xxhash's).
"""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
         "-Wno-cast-function-type"]

setup(
    ext_modules=[
        Extension("routing._blocktable", ["routing/_blocktable.c"], extra_compile_args=FLAGS),
        Extension("routing._chain", ["routing/_chain.c"], extra_compile_args=FLAGS),
    ]
)
