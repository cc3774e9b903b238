"""``python -m bench.sim``: see :mod:`bench.sim.cli`."""

from bench.sim.cli import main

raise SystemExit(main())
