"""Proof that a restructuring moved no behaviour: the engine of an older commit and of
this checkout run the same scripted scenarios, and their server calls, drafter calls,
round records and output must be identical.

    python scripts/restructure_check.py                # against da87e39
    python scripts/restructure_check.py --old REV

Each side runs in its own interpreter with only its own tree on `sys.path`; the
scenarios use nothing but the engine's public entry points (`Generation`, the draft
session contract, `DrafterSupervisor`). The server is scripted (a fixed greedy
continuation, a fixed sampling distribution), the drafter a deterministic function of
the sequence, and the policies fixed (no adaptive length, overlap on or off), so no
timing can change a decision; the records' timings are left out of the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
N_VOCAB = 500
EOG = 499
N_PROMPT = 3


def target_next(sequence: Sequence[int]) -> int:
    """The scripted target's greedy token after `sequence`."""
    return (sequence[-1] * 31 + len(sequence) * 7) % 211 + 10


def draft_next(sequence: Sequence[int], miss_every: int) -> int:
    """The drafter: the target's token, wrong where the position says so."""
    token = target_next(sequence)
    return token + 1 if miss_every and len(sequence) % miss_every == 0 else token


class ScriptedServer:
    """The engine's view of llama-server, scripted; logs every call."""

    def __init__(self, log: list[Any], eog_at: int | None = None) -> None:
        self.log = log
        self.eog_at = eog_at  # generated position whose token is the EOG token
        self.decodes = 0

    def _token(self, sequence: Sequence[int]) -> int:
        if self.eog_at is not None and len(sequence) - N_PROMPT == self.eog_at:
            return EOG
        return target_next(sequence)

    def _candidates(self, sequence: Sequence[int]) -> tuple[tuple[int, bytes, float], ...]:
        base = self._token(sequence)
        ids = [base, (base + 1) % 211 + 10, (base + 2) % 211 + 10]
        return tuple((t, f"<{t}>".encode(), p) for t, p in zip(ids, (0.6, 0.3, 0.1), strict=True))

    async def verify(self, context, draft, spec=None, seed=0):
        self.log.append(["verify", len(context), list(draft), spec is not None, int(seed)])
        await asyncio.sleep(0.03)  # drafting ahead finishes its few tokens meanwhile
        self.decodes += 1
        results = []
        for i in range(len(draft) + 1):
            sequence = list(context) + list(draft[:i])
            if spec is None:
                token, candidates = self._token(sequence), None
            else:
                candidates = self._candidates(sequence)
                token = candidates[(seed + len(sequence)) % 3][0]
            results.append(
                _server_data("VerifyResult")(
                    token, f"<{token}>", token == EOG, 0, id_slot=i, prompt_n=1,
                    candidates=candidates,
                )
            )  # fmt: skip
        return results

    async def plain_run(self, context, n, spec=None, seed=0):
        self.log.append(["plain_run", len(context), n, spec is not None, int(seed)])
        sequence, tokens = list(context), []
        for _ in range(n):
            token = self._token(sequence)
            tokens.append(token)
            sequence.append(token)
            self.decodes += 1
            if token == EOG:
                break
        stop = "eos" if tokens and tokens[-1] == EOG else "limit"
        content = "".join(f"<{t}>" for t in tokens if t != EOG)
        return _server_data("PlainRun")(tokens, content, stop, cached=len(context), id_slot=0)

    async def metrics(self):
        return {"llamacpp:n_decode_total": self.decodes, "llamacpp:prompt_tokens_total": 0}

    async def eog_tokens(self):
        return frozenset({EOG})

    async def token_bytes(self, token):
        return b"" if token == EOG else f"<{token}>".encode()

    async def tokens_bytes(self, tokens):
        return [await self.token_bytes(t) for t in tokens]


class ScriptedSession:
    """A draft session (npu_draft contract) drafting `draft_next`; logs its calls."""

    def __init__(
        self, log: list[Any], miss_every: int, fail_at: int | None, garbage_at: int | None
    ):
        self.log = log
        self.miss_every = miss_every
        self.fail_at = fail_at  # raise when asked to draft at this sequence length
        self.garbage_at = garbage_at  # draft an id outside the vocabulary there
        self._tokens: list[int] = []

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def sync(self, tokens: Sequence[int]):
        from npu_draft.protocol import SyncStats

        self.log.append(["sync", len(tokens)])
        self._tokens = list(tokens)
        return SyncStats(reused=0, appended=len(tokens))

    def propose(self, k, sampling=None, rng=None, cancel=None):
        import numpy as np

        from npu_draft.protocol import Draft, SparseDist

        sampled = sampling is not None and not sampling.greedy
        self.log.append(["propose", len(self._tokens), k, sampled])
        draft = Draft(dists=[] if sampled else None)
        for _ in range(k):
            if cancel is not None and cancel.cancelled:
                break
            n = len(self._tokens)
            if n == self.fail_at:
                raise RuntimeError("scripted drafter failure")
            token = (
                N_VOCAB + 7 if n == self.garbage_at else draft_next(self._tokens, self.miss_every)
            )
            self._tokens.append(token)
            draft.tokens.append(token)
            draft.probs.append(0.9 if n % 3 else 0.5)
            if sampled:
                other = (token + 1) % 211 + 10
                dist = SparseDist(np.array([token, other]), np.array([0.7, 0.3]))
                draft.dists.append(dist)  # type: ignore[union-attr]
        return draft

    def next_logits(self):
        raise NotImplementedError

    def close(self) -> None:
        self.log.append(["close"])


def _find(name: str, modules: Sequence[str]) -> Any:
    """`name` from the first module that has it: the new tree's neutral modules, or
    the old tree's client."""
    import importlib

    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(name)


def _server_data(name: str) -> Any:
    return _find(name, ("proxy.data.verify", "proxy.server.upstream"))


def _sampling_spec(seed: int) -> Any:
    from npu_draft.protocol import SamplingParams

    spec = _find("SamplingSpec", ("proxy.data.sampling", "proxy.server.upstream"))
    return spec(SamplingParams(0.8, 3, 1.0, 0.0), seed=seed)


def _propose_only(session: ScriptedSession, hang_at: int | None) -> Any:
    """A drafter that only proposes (`DrafterBase`), hanging at its call number
    `hang_at`: the shape of the test suite's fault-injecting drafters."""
    from proxy.engine.drafting import DrafterBase

    class ProposeOnly(DrafterBase):
        calls = 0

        async def propose(self, committed: Sequence[int], k: int) -> list[int]:
            self.calls += 1
            if self.calls == hang_at:
                await asyncio.sleep(3600)
            session.sync(committed)
            return session.propose(k).tokens

        async def close(self) -> None:
            session.close()

    return ProposeOnly()


def _policies(k: int, gate_every: int | None):
    """Fixed policies: no adaptive length; a plain-run gate that alternates, or none."""
    from proxy.policies import PlainRunGate

    class Alternate(PlainRunGate):
        """A plain run of 4 tokens after every `gate_every` decisions."""

        calls = 0

        def decide(self) -> int:
            Alternate.calls += 1
            return 4 if Alternate.calls % gate_every == 0 else 0

    gate = Alternate("auto") if gate_every else None
    import proxy.policies as policies

    if hasattr(policies.Policies, "fresh"):  # the old tree's constructor
        return policies.Policies.fresh(k, adaptive=False, overlap="off", plain_runs=gate)
    from dataclasses import replace

    from proxy.engine import EngineSettings

    greedy = EngineSettings(k=k, adaptive=False, overlap="off").policies().for_request(None)
    return replace(greedy, plain_runs=gate)


SCENARIOS: dict[str, dict[str, Any]] = {
    "greedy k4": {"k": 4, "miss_every": 5},
    "greedy k3 no early draft": {"k": 3, "miss_every": 4, "early_draft": False},
    "greedy k4 drafting ahead": {"k": 4, "miss_every": 6, "overlap": "on"},
    "greedy k5 all accepted, ahead": {"k": 5, "miss_every": 0, "overlap": "on"},
    "greedy stop string and eog": {"k": 4, "miss_every": 5, "stop": ["<77>"], "eog_at": 21},
    "greedy n_predict cut": {"k": 4, "miss_every": 3, "n_predict": 11},
    "greedy context limit": {"k": 6, "miss_every": 7, "n_ctx": 20},
    "greedy plain runs": {"k": 3, "miss_every": 5, "gate_every": 2},
    "drafter raises": {"k": 4, "miss_every": 5, "fail_at": N_PROMPT + 9},
    "guarded drafter raises": {"k": 4, "miss_every": 5, "fail_at": N_PROMPT + 9, "guard": True},
    "guarded drafter garbage": {"k": 4, "miss_every": 5, "garbage_at": N_PROMPT + 6, "guard": True},
    "guarded, drafting ahead": {"k": 4, "miss_every": 6, "overlap": "on", "guard": True},
    "sampling seeded": {"k": 3, "miss_every": 4, "sampling_seed": 1234},
    "sampling seeded, guarded": {"k": 4, "miss_every": 4, "sampling_seed": 99, "guard": True},
    "no drafter": {"k": 4, "no_drafter": True},
    "propose-only drafter": {"k": 3, "miss_every": 4, "propose_only": True},
    "guarded drafter times out": {
        "k": 3,
        "miss_every": 4,
        "propose_only": True,
        "guard": True,
        "hang_at": 3,
        "timeout_s": 0.2,
    },
}

METRICS = "/metrics policy and reliability gauges"
TIMING_FIELDS = {"drafter_busy"}  # a wall-time comparison inside the record


def _record(record: Any) -> dict[str, Any]:
    import dataclasses

    fields = dataclasses.asdict(record)
    return {k: v for k, v in fields.items() if not k.endswith("_ms") and k not in TIMING_FIELDS}


async def _run_scenario(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    from proxy.engine import EngineSettings, Generation, GenerationParams
    from proxy.engine.drafting import AsyncSessionDrafter
    from proxy.engine.server_text import PieceCache

    server_log: list[Any] = []
    drafter_log: list[Any] = []
    server = ScriptedServer(server_log, spec.get("eog_at"))
    k = spec["k"]

    def open_drafter():
        session = ScriptedSession(
            drafter_log, spec.get("miss_every", 0), spec.get("fail_at"), spec.get("garbage_at")
        )
        if spec.get("propose_only"):
            return _propose_only(session, spec.get("hang_at"))
        return AsyncSessionDrafter(session)

    supervisor = None
    if spec.get("no_drafter"):
        drafter = None
    elif spec.get("guard"):
        from proxy.drafter_guard import DrafterSupervisor

        supervisor = DrafterSupervisor(
            open_drafter, propose_timeout_s=spec.get("timeout_s", 30.0), n_vocab=N_VOCAB
        )
        drafter = await supervisor.open()
    else:
        drafter = open_drafter()
    seed = spec.get("sampling_seed")
    params = GenerationParams(
        n_predict=spec.get("n_predict", 40),
        stop=list(spec.get("stop", [])),
        sampling=_sampling_spec(seed) if seed is not None else None,
    )
    settings = EngineSettings(
        k=k,
        adaptive=False,
        overlap=spec.get("overlap", "off"),
        early_draft=spec.get("early_draft", True),
        check_decodes=True,
    )
    kwargs: dict[str, Any] = {}
    if spec.get("gate_every") or spec.get("overlap", "off") == "off":
        kwargs["policies"] = _policies(k, spec.get("gate_every"))
    if supervisor is not None and hasattr(supervisor, "bounded"):
        kwargs["guard"] = supervisor  # the new tree: the proposer asks the guard itself
    generation = Generation(
        server, list(range(1, N_PROMPT + 1)), params, spec.get("n_ctx", 1000), drafter,
        PieceCache(server), settings=settings, **kwargs,
    )  # fmt: skip
    events = [[e.token, e.text.decode("latin-1") if isinstance(e.text, bytes) else str(e.text)]
              async for e in generation.run()]  # fmt: skip
    await asyncio.sleep(0.05)  # background closes finish
    result = generation.result
    assert result is not None
    return {
        "events": events,
        "server_calls": server_log,
        "drafter_calls": drafter_log,
        "records": [_record(r) for r in result.rounds],
        "result": {
            "tokens": result.tokens,
            "content": result.content.decode("latin-1"),
            "stop_type": result.stop_type,
            "stopping_word": result.stopping_word,
            "truncated": result.truncated,
            "drafter_failed": result.drafter_failed,
            "sampled": result.sampled,
            "timings_counts": {
                key: value
                for key, value in result.timings().items()
                if not key.endswith("_ms") and "per_" not in key
            },
        },
        "supervisor": supervisor.snapshot() if supervisor is not None else None,
    }


def _metrics_pages() -> dict[str, Any]:
    """The policy and reliability gauges of /metrics after the same fixed rounds."""
    from types import SimpleNamespace

    from proxy.engine import RoundRecord
    from proxy.policies import DraftLengthPolicy, OverlapPolicy, PlainRunGate, Policies

    records = [
        RoundRecord(
            n, min(n, i % 4), min(n, i % 4) + 1, 2.0 * n, 30.0 + 3 * n, 1.0, first=i == 0,
            round_ms=40.0 + 5 * n, fresh_tokens=n, fresh_ms=2.0 * n, draft_probs=[0.8] * n,
            plain_run=i % 7 == 5, n_run_tokens=16 if i % 7 == 5 else 0,
            drafted_ahead=bool(i % 2), next_drafted=n, next_draft_ms=1.0 + i % 3,
        )
        for i, n in enumerate([4, 3, 4, 2, 4, 1, 3, 4, 2, 4, 3, 4, 4, 1, 2, 3] * 3)
    ]  # fmt: skip
    scheduler = SimpleNamespace(active=1, queued=2, rejected=3)
    drafters = {"sessions_open": 1, "failures": 2, "recreations": 1}
    try:
        from proxy.metrics import policy_page, reliability_page
        from proxy.policies import SharedPolicies
    except ImportError:  # the old tree: the API rendered them from its state
        from proxy.api.app import policy_metrics, reliability_metrics

        state = SimpleNamespace(
            draft_lengths=DraftLengthPolicy(4, True, "formula"),
            overlap_policy=OverlapPolicy("auto"),
            plain_run_gate=PlainRunGate("auto"),
            sampled_run_gate=PlainRunGate("auto", name="unseeded sampling"),
            scheduler=scheduler, drafters=SimpleNamespace(snapshot=lambda: drafters),
            client_disconnects=4, upstream_failures=5, server_restarts=lambda: 6,
        )  # fmt: skip
        policies = Policies(state.draft_lengths, state.overlap_policy, state.plain_run_gate)
        for record in records:
            policies.observe(record)
            policies.observe_next_draft(record, record.next_drafted, record.next_draft_ms)
        return {"policies": policy_metrics(state), "reliability": reliability_metrics(state)}
    shared = SharedPolicies.build(4, True, "formula", "auto", "auto")
    policies = shared.for_request(None)
    for record in records:
        policies.observe(record)
        policies.observe_next_draft(record)
    return {
        "policies": policy_page(shared),
        "reliability": reliability_page(scheduler, drafters, 4, 5, 6),  # type: ignore[arg-type]
    }


async def _emit() -> dict[str, Any]:
    out = {name: await _run_scenario(name, spec) for name, spec in SCENARIOS.items()}
    out[METRICS] = _metrics_pages()
    return out


def _side(tree: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--emit"],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the scenarios failed\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def _old_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", rev, "proxy", "npu_draft"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="da87e39", help="the commit to compare against")
    parser.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emit:
        print(json.dumps(asyncio.run(_emit())))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        old = _side(_old_tree(args.old, Path(tmp)))
    new = _side(ROOT)
    differ = 0
    for name in [*SCENARIOS, METRICS]:
        same = old[name] == new[name]
        differ += not same
        run = new[name]
        what = (
            f"{sum(len(page.splitlines()) for page in run.values())} lines"
            if name == METRICS
            else f"{len(run['events'])} tokens, {len(run['server_calls'])} server calls, "
            f"{len(run['drafter_calls'])} drafter calls, {len(run['records'])} records"
        )
        print(f"{'same' if same else 'DIFFERENT':9} {name}: {what}")
        if not same:
            for part in old[name]:
                if old[name][part] != new[name][part]:
                    print(f"  {part}:\n    old {old[name][part]}\n    new {new[name][part]}")
    total = len(SCENARIOS) + 1
    print(f"{total - differ} of {total} comparisons identical (old {args.old})")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
