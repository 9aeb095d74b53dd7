#!/usr/bin/env python3
"""What one verification round costs on llama-server, and why (proxy/bench/verify_cost.py).

python scripts/verify_cost.py --models DIR --context 512,4k \
  --variant 'base=-ngl 99 -fa on' --variant 'fa-off=-ngl 99 -fa off' -o verify-cost.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from proxy.bench.verify_cost import main

if __name__ == "__main__":
    sys.exit(main())
