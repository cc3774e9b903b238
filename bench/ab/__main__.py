"""``python -m bench.ab``: see ``bench.ab.cli``."""

import sys

from bench.ab.cli import main

if __name__ == "__main__":
    sys.exit(main())
