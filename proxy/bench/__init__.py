"""`npu-spec bench`: plain vs llama.cpp's own drafting vs the proxy vs the oracle.

    npu-spec bench --models DIR -k 2,4,6,8 --context 512,4k --repeats 3 \\
        --server-args='-ngl 99 -fa on' --builtin-args='-ngld 99' --provider cuda \\
        --oracle-acceptance 0.6,0.8 --oracle-delay-ms 11 -o benchmarks/results/x.json

DIR is a `npu-spec make-models` folder (target.gguf, draft.gguf, draft/); or give
--target, --draft-gguf and --drafter. The table goes to stdout, every raw number to
the JSON (written after each mode, so a session cut short keeps what it measured).

Modules: prompts (the prompt set as token prompts), modes (starting each way of
serving), client (one timed streamed request), prom (metrics parsing), procmem
(peak memory), host (machine facts), stats and costmodel (the numbers), report (the
table), runner (the session), cli (options).
"""
