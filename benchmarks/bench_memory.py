"""Memory at the peers' level (issue 20): activation sections; see `memory_activations.py`.

    PYTHONPATH=$PWD python benchmarks/bench_memory.py                      # every section
    PYTHONPATH=$PWD python benchmarks/bench_memory.py --section freeing    # one (repeatable)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory_activations import ACTIVATION_SECTIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(ACTIVATION_SECTIONS), action="append",
                        help="run only this section (repeatable); default: all")
    for name in parser.parse_args().section or list(ACTIVATION_SECTIONS):
        ACTIVATION_SECTIONS[name]()


if __name__ == "__main__":
    main()
