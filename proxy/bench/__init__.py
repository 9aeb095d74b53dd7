"""`npu-spec bench`: plain vs llama.cpp's own drafting vs the proxy vs the oracle.

    npu-spec bench --models DIR -k 2,4,6 --mode-k proxy=4 --mode-k oracle=4 \\
        --context 512,4k --repeats 3 --modes plain,builtin,builtin-synth,proxy,oracle \\
        --server-args='-ngl 99 -fa on' --builtin-args='-ngld 99' --provider cuda \\
        --oracle-acceptance 0.77 --oracle-delay-steps 0.12,0.27 -o benchmarks/results/x.json

DIR is a `npu-spec make-models` folder (target.gguf, draft.gguf, draft/); or give
--target, --draft-gguf and --drafter. The table goes to stdout, every raw number to
the JSON (written after each mode, so a session cut short keeps what it measured).

Modules: prompts (the prompt set as token prompts), modes (starting each way of
serving), client (one timed streamed request), prom (counter deltas), procmem
(peak memory), host (machine facts), verify_cost (round costs: its own command, and
the t_v(k) each bench run measures), stats and costmodel (the numbers, the
ceilings), report (the table), predict (the Strix Halo prediction), runner (the
session), options and results (shared parsers, result files), cli (options).
"""
