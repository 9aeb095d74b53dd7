"""Backend `oracle`: replays the target's own greedy output, corrupted on purpose.

The oracle knows what the target will write for a fixed set of prompts (recorded
from a plain llama-server greedy run, non-streamed: streamed ids leave out tokens
that end inside a UTF-8 character) and proposes it, replacing each drafted token
by a wrong one with probability 1 - acceptance. It isolates the proxy's machinery
(verification cost, overhead, overlap) from drafter quality: acceptance and
per-token drafting time are chosen, not measured.

Corruption is a pure function of (seed, reference, position in the continuation),
so a run is repeatable and a position drafted twice gets the same verdict. Per
position the verdicts are independent Bernoulli(acceptance) draws, which is exactly
the i.i.d. acceptance the cost model (proxy/bench/costmodel.py) assumes.

A reference may carry branches: where the target's top-2 were a near-tie, the greedy
continuation after the runner-up, recorded by the bench (proxy.bench.branches). A GPU
target can flip such a tie when the batch shape changes; when the committed sequence
takes a branch's runner-up at its position, the oracle follows that branch, so a flip
does not leave it without drafts for the rest of the answer. Past a branch point the
verdicts are salted by the branch, so they stay a pure function of (seed, reference,
branch, position). Up to the branch point a branch is its reference: the oracle drafts
the reference's token there, as the plain run wrote it.

Off every recorded path (a prompt it does not know, or a committed sequence that left
the recorded continuation and its branches) it proposes nothing: the proxy then decodes
plainly (the engine counts such rounds: npu_spec_empty_draft_rounds_total). Its
own drafts may leave the path (a corrupted token): it drafts on after them, as a real
drafter does, so a round verifies as many drafts as it asked for (the drafts after a
wrong one cannot be accepted, whatever they are).

Each greedy draft token comes with a runner-up (`Draft.runner_ups`): where the token is
wrong, the target's own token in a share `runner_up_hits` h of positions (drawn per
position, apart from the verdicts), else another wrong token. The engine drafts the
lines after the runner-ups while the server verifies (`npu-spec bench
--oracle-runner-up-hits`), each token at the oracle's delay like any other.

The per-token delay is a sleep on the calling thread (the engine's drafter thread):
it holds neither the event loop nor the GIL, so the drafter runs truly in parallel
with the proxy and the server, as an NPU does.

Folder form (loaded by `OracleDraftModel.from_folder`): `oracle.json` holding

    {"acceptance": 0.8, "delay_ms": 11.0, "seed": 0, "vocab_size": 151936,
     "runner_up_hits": 0.0,
     "references": [[[prompt tokens...], [continuation tokens...],
                     [[position, runner-up token, [continuation after it...]], ...]], ...]}

where the third item (the branches) is optional (older folders have none).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    DrafterInfo,
    SamplingParams,
    SparseDist,
    SyncStats,
    common_prefix_length,
)

ORACLE_FILE = "oracle.json"
QWEN_VOCAB = 151936
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a fast, platform-independent integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fingerprint(tokens: Sequence[int]) -> int:
    """Stable id of a reference (its prompt), independent of list order."""
    h = _mix64(len(tokens))
    for token in tokens[:256]:
        h = _mix64(h ^ (int(token) & _MASK64))
    return h


@dataclass(frozen=True)
class Branch:
    """The target's greedy continuation after taking the runner-up at a near-tie."""

    position: int  # index into the reference's continuation where the runner-up is taken
    token: int  # the runner-up
    continuation: tuple[int, ...]  # the greedy output after it


NO_FORK = 1 << 62  # a reference's own path: never salted
# (prompt, continuation) or (prompt, continuation, branches)
RecordedReference = (
    tuple[Sequence[int], Sequence[int]] | tuple[Sequence[int], Sequence[int], Sequence[Branch]]
)


@dataclass(frozen=True)
class Reference:
    """One recorded path: a reference's continuation, or one of its branches (then
    `continuation` is the reference's up to `fork`, the runner-up, and the branch's)."""

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    full: list[int]  # prompt + continuation, for prefix comparisons at C speed
    key: int  # _fingerprint(prompt), salts the corruption hash
    fork: int = NO_FORK  # a branch: where it leaves its reference
    salt: int = 0  # a branch: salts the verdicts from `fork` on
    branches: tuple[Reference, ...] = ()  # a reference: its branches' paths

    @classmethod
    def of(
        cls, prompt: Sequence[int], continuation: Sequence[int], branches: Sequence[Branch] = ()
    ) -> Reference:
        p = tuple(int(t) for t in prompt)
        c = tuple(int(t) for t in continuation)
        key = _fingerprint(p)
        paths = []
        for b in branches:
            if not 0 <= b.position < len(c) or b.token == c[b.position]:
                raise ValueError(f"branch at {b.position} (token {b.token}) leaves no path")
            path = (*c[: b.position], int(b.token), *map(int, b.continuation))
            salt = _mix64(_mix64(b.position) ^ (int(b.token) & _MASK64))
            paths.append(cls(p, path, [*p, *path], key, b.position, salt))
        return cls(p, c, [*p, *c], key, branches=tuple(paths))

    def key_at(self, position: int) -> int:
        return self.key ^ self.salt if position >= self.fork else self.key

    def matched(self, tokens: list[int], start: int = 0) -> int:
        """Length of the common prefix of `tokens` and this reference, given that the
        first `start` tokens are already known to match."""
        end = min(len(tokens), len(self.full))
        if tokens[start:end] == self.full[start:end]:
            return end
        return start + common_prefix_length(tokens[start:end], self.full[start:end])

    def position(self, tokens: list[int], on_path: int) -> int | None:
        """Index into the continuation after `tokens` (of which `on_path` lie on this
        reference); None when off the path."""
        if on_path != len(tokens) or len(tokens) < len(self.prompt):
            return None
        if self.fork != NO_FORK and len(tokens) <= len(self.prompt) + self.fork:
            # a branch not yet taken: its reference drafts there
            return None
        return len(tokens) - len(self.prompt)


@dataclass(frozen=True)
class OracleConfig:
    acceptance: float = 1.0
    delay_ms: float = 0.0
    seed: int = 0
    vocab_size: int = QWEN_VOCAB
    # The share of wrong drafts whose runner-up is the target's token (the rest get
    # another wrong runner-up): what the engine's runner-up lines can hit.
    runner_up_hits: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"oracle acceptance {self.acceptance} is not in [0, 1]")
        if not 0.0 <= self.runner_up_hits <= 1.0:
            raise ValueError(f"oracle runner-up hits {self.runner_up_hits} is not in [0, 1]")
        if self.delay_ms < 0:
            raise ValueError(f"oracle delay {self.delay_ms} ms is negative")
        if self.vocab_size < 2:
            raise ValueError("oracle vocab_size must be at least 2")


def drafted_token(config: OracleConfig, ref: Reference, position: int) -> int:
    """What the oracle proposes at `position` of `ref`'s continuation."""
    true_token = ref.continuation[position]
    h = _mix64(_mix64(config.seed & _MASK64) ^ ref.key_at(position) ^ _mix64(position))
    uniform = (h >> 11) / float(1 << 53)
    if uniform < config.acceptance:
        return true_token
    # Any other id, chosen by a second hash: guaranteed to differ from the truth.
    offset = 1 + _mix64(h) % (config.vocab_size - 1)
    return (true_token + offset) % config.vocab_size


def runner_up_hit(config: OracleConfig, ref: Reference, position: int) -> bool:
    """Whether the drafter's runner-up at `position` (where its draft was wrong) is the
    target's token, a draw of its own (salted apart from the verdicts), as repeatable
    as they are."""
    if config.runner_up_hits <= 0.0:
        return False
    salt = 0x52554E4E45525550  # "RUNNERUP"
    h = _mix64(_mix64((config.seed ^ salt) & _MASK64) ^ ref.key_at(position) ^ _mix64(position))
    return (h >> 11) / float(1 << 53) < config.runner_up_hits


def oracle_runner_up(config: OracleConfig, ref: Reference, position: int, drafted: int) -> int:
    """The oracle's second choice at `position`, where it drafted `drafted`: the target's
    token where that draft is wrong and the runner-up hits (`runner_up_hit`), else a
    token that is neither."""
    truth = ref.continuation[position]
    if drafted != truth and runner_up_hit(config, ref, position):
        return truth
    other = (drafted + 1) % config.vocab_size
    if other == truth:
        other = (other + 1) % config.vocab_size
    return other


class OracleDraftSession:
    def __init__(self, model: OracleDraftModel) -> None:
        self._model = model
        self._tokens: list[int] = []
        self._ref: Reference | None = None  # the reference the prompt belongs to
        self._on_path = 0  # leading tokens of the sequence that lie on _ref
        self._synced = 0  # length of the sequence given by the last sync (the rest: drafts)

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        new = list(map(int, tokens))
        old = self._tokens
        if len(old) <= len(new) and new[: len(old)] == old:  # the common case, at C speed
            reused = len(old)
        else:
            reused = common_prefix_length(old, new)
        self._tokens = new
        self._synced = len(new)
        if self._ref is not None:
            self._on_path = self._ref.matched(new, min(self._on_path, reused))
        return SyncStats(reused=reused, appended=len(new) - reused)

    def _locate(self) -> tuple[Reference, int] | None:
        if self._ref is not None:
            position = self._ref.position(self._tokens, self._on_path)
            if position is not None:
                return self._ref, position
            if max(len(self._ref.prompt), self._synced) <= self._on_path < len(self._tokens):
                # the path was left among its own drafts since the last sync (not by the
                # committed sequence): drafting on after its own wrong draft
                return self._ref, len(self._tokens) - len(self._ref.prompt)
        for ref in self._model.references:
            on_path = ref.matched(self._tokens)
            if on_path < len(ref.prompt):
                continue  # another prompt: neither it nor its branches
            # the reference first: before a branch point it owns the sequence
            for path in (ref, *ref.branches):
                if path is self._ref:
                    continue
                shared = min(on_path, len(ref.prompt) + path.fork)  # the prefix it shares
                n = on_path if path is ref else path.matched(self._tokens, shared)
                position = path.position(self._tokens, n)
                if position is not None:
                    self._ref, self._on_path = path, n
                    return path, position
        return None

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        draft = Draft(dists=None if sampling.greedy else [])
        found = self._locate()
        if found is None:
            return draft
        ref, position = found
        config = self._model.config
        delay_s = config.delay_ms / 1e3
        for step in range(min(k, len(ref.continuation) - position)):
            if cancel is not None and cancel.cancelled:
                break
            if delay_s > 0:
                time.sleep(delay_s)  # emulate a drafter of this per-token speed
            token = drafted_token(config, ref, position + step)
            draft.tokens.append(token)
            draft.probs.append(1.0)
            if draft.dists is None:
                draft.runner_ups.append(oracle_runner_up(config, ref, position + step, token))
            else:  # a point mass: the target accepts with p(x)
                draft.dists.append(
                    SparseDist(np.array([token], np.int64), np.array([1.0], np.float64))
                )
        self._tokens.extend(draft.tokens)
        self._on_path = ref.matched(self._tokens, self._on_path)
        return draft

    def next_logits(self) -> np.ndarray:
        logits = np.full(self._model.config.vocab_size, -30.0, dtype=np.float32)
        found = self._locate()
        if found is not None and found[1] < len(found[0].continuation):
            logits[drafted_token(self._model.config, found[0], found[1])] = 0.0
        return logits

    def close(self) -> None:
        self._tokens = []
        self._ref = None
        self._on_path = 0
        self._synced = 0


class OracleDraftModel:
    def __init__(
        self,
        references: Sequence[RecordedReference],
        config: OracleConfig | None = None,
        name: str = "oracle",
    ) -> None:
        self.config = config = config or OracleConfig()
        # its branches hang off each reference (Reference.branches)
        self.references = [Reference.of(*entry) for entry in references]
        self.info = DrafterInfo(
            name=name,
            backend="oracle",
            provider="none",
            vocab_size=config.vocab_size,
            max_context=1 << 30,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> OracleDraftModel:
        path = Path(folder) / ORACLE_FILE
        data = json.loads(path.read_text())
        return cls.from_dict(data, name=str(folder))

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "oracle") -> OracleDraftModel:
        config = OracleConfig(
            acceptance=float(data.get("acceptance", 1.0)),
            delay_ms=float(data.get("delay_ms", 0.0)),
            seed=int(data.get("seed", 0)),
            vocab_size=int(data.get("vocab_size", QWEN_VOCAB)),
            runner_up_hits=float(data.get("runner_up_hits", 0.0)),
        )
        references = [
            (entry[0], entry[1], [Branch(int(b[0]), int(b[1]), tuple(b[2])) for b in entry[2]])
            if len(entry) > 2
            else (entry[0], entry[1])
            for entry in data.get("references", [])
        ]
        return cls(references, config, name)

    def open_session(self) -> OracleDraftSession:
        return OracleDraftSession(self)

    def close(self) -> None:
        pass


def is_oracle_folder(path: str | Path) -> bool:
    return (Path(path) / ORACLE_FILE).is_file()


def write_oracle_folder(
    folder: str | Path,
    references: Sequence[RecordedReference],
    config: OracleConfig,
) -> Path:
    """Write `oracle.json` (creating the folder); returns the folder. Each reference is
    (prompt, continuation) or (prompt, continuation, branches)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "acceptance": config.acceptance,
        "delay_ms": config.delay_ms,
        "seed": config.seed,
        "vocab_size": config.vocab_size,
        "runner_up_hits": config.runner_up_hits,
        "references": [_entry(*reference) for reference in references],
    }
    (folder / ORACLE_FILE).write_text(json.dumps(data))
    return folder


def _entry(
    prompt: Sequence[int], continuation: Sequence[int], branches: Sequence[Branch] = ()
) -> list[Any]:
    entry: list[Any] = [list(map(int, prompt)), list(map(int, continuation))]
    if branches:  # without branches: the old two-item form
        entry.append([[b.position, b.token, list(map(int, b.continuation))] for b in branches])
    return entry
