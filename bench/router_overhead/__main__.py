"""``python -m bench.router_overhead``: see the package docstring."""

from bench.router_overhead.cli import main

if __name__ == "__main__":
    main()
