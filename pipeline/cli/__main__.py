"""`python -m pipeline.cli` runs the `pipesched` command line."""

import sys

from pipeline.cli import main

__all__: list[str] = []

sys.exit(main())
