#!/usr/bin/env python3
"""Benchmark plain / builtin / proxy / oracle side by side (same as `npu-spec bench`).

python scripts/bench.py --models DIR -k 2,4,6,8 --context 512,4k --repeats 3
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from proxy.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
