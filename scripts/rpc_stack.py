#!/usr/bin/env python3
"""Run a command with ggml-rpc-servers up on loopback, optionally behind a delay relay
(proxy/bench/rpc_stack.py).

python scripts/rpc_stack.py --servers 2 --delay-ms 1 -- \
  npu-spec verify-cost --models DIR --variant 'rpc=--rpc {rpc} -ngl 99'
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from proxy.bench.rpc_stack import main

if __name__ == "__main__":
    sys.exit(main())
