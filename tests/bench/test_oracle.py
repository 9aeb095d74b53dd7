"""The oracle drafter: deterministic, acceptance close to the chosen a, and harmless
off its reference path."""

from __future__ import annotations

import time

import numpy as np
import pytest

from npu_draft.oracle import (
    OracleConfig,
    OracleDraftModel,
    is_oracle_folder,
    write_oracle_folder,
)
from npu_draft.protocol import CancelToken, DraftModel, DraftSession, SamplingParams
from proxy.bench.costmodel import expected_tokens_per_round

VOCAB = 1000


def _reference(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 20).tolist()
    return prompt, rng.integers(0, VOCAB, n).tolist()


def _model(a: float, n: int = 200, seed: int = 0, delay_ms: float = 0.0) -> OracleDraftModel:
    config = OracleConfig(acceptance=a, delay_ms=delay_ms, seed=seed, vocab_size=VOCAB)
    return OracleDraftModel([_reference(n)], config)


def _speculate(model: OracleDraftModel, k: int) -> tuple[int, int, int, int]:
    """Run greedy rounds against the reference as the engine would:
    (rounds, drafted, accepted, rejections)."""
    prompt, truth = _reference(len(model.references[0].continuation))
    session = model.open_session()
    committed = list(prompt)
    rounds = drafted = accepted = rejections = 0
    while len(committed) - len(prompt) < len(truth):
        done = len(committed) - len(prompt)
        session.sync(committed)
        draft = session.propose(min(k, len(truth) - done - 1))
        run = 0
        while run < len(draft) and draft.tokens[run] == truth[done + run]:
            run += 1
        rejections += run < len(draft)
        committed += truth[done : done + run + 1]  # accepted run + the target's token
        rounds += 1
        drafted += len(draft)
        accepted += run
    assert committed[len(prompt) :] == truth
    return rounds, drafted, accepted, rejections


def test_oracle_implements_the_protocol() -> None:
    model = _model(0.5)
    assert isinstance(model, DraftModel)
    assert isinstance(model.open_session(), DraftSession)
    assert model.info.backend == "oracle"
    assert model.info.vocab_size == VOCAB


def test_oracle_is_deterministic_per_seed_and_position() -> None:
    prompt, _ = _reference(200)

    def proposals(seed: int) -> list[list[int]]:
        session = _model(0.5, seed=seed).open_session()
        out = []
        for step in range(0, 100, 7):
            session.sync(prompt + _reference(200)[1][:step])
            out.append(session.propose(5).tokens)
        return out

    assert proposals(1) == proposals(1)
    assert proposals(1) != proposals(2)


def test_full_acceptance_replays_and_zero_acceptance_never_matches() -> None:
    prompt, truth = _reference(50)
    session = _model(1.0, n=50).open_session()
    session.sync(prompt)
    assert session.propose(8).tokens == truth[:8]
    assert list(session.tokens) == prompt + truth[:8]
    session = _model(0.0, n=50).open_session()
    for start in range(0, 45, 5):
        session.sync(prompt + truth[:start])
        draft = session.propose(5)
        assert all(t != truth[start + i] for i, t in enumerate(draft.tokens))
        assert all(0 <= t < VOCAB for t in draft.tokens)


@pytest.mark.parametrize("a", [0.4, 0.8])
def test_acceptance_statistics_match_the_chosen_rate(a: float) -> None:
    k = 4
    rounds, _drafted, accepted, rejections = _speculate(_model(a, n=6000, seed=3), k)
    # per-token acceptance: accepted out of the positions the rounds reached
    assert accepted / (accepted + rejections) == pytest.approx(a, abs=0.02)
    tokens_per_round = 6000 / rounds
    assert tokens_per_round == pytest.approx(expected_tokens_per_round(a, k), rel=0.03)


def test_off_the_reference_path_proposes_nothing() -> None:
    prompt, truth = _reference(50)
    session = _model(1.0, n=50).open_session()
    session.sync([7, 8, 9])  # unknown prompt
    assert session.propose(4).tokens == []
    wrong = (truth[0] + 1) % VOCAB
    session.sync([*prompt, wrong])  # left the recorded continuation
    assert session.propose(4).tokens == []
    session.sync(prompt + truth)  # at the end of the reference
    assert session.propose(4).tokens == []
    session.sync(prompt + truth[:48])  # near the end: only what is left
    assert session.propose(4).tokens == truth[48:]


def test_sync_reports_reuse_and_next_logits_follow_the_draft() -> None:
    prompt, truth = _reference(50)
    session = _model(1.0, n=50).open_session()
    stats = session.sync(prompt)
    assert (stats.reused, stats.appended) == (0, len(prompt))
    session.propose(3)
    stats = session.sync([*prompt, truth[0], truth[1], 5])
    assert (stats.reused, stats.appended) == (len(prompt) + 2, 1)
    session.sync(prompt)
    assert int(np.argmax(session.next_logits())) == truth[0]


def test_delay_and_cancel() -> None:
    prompt, _ = _reference(50)
    session = _model(1.0, n=50, delay_ms=5.0).open_session()
    session.sync(prompt)
    started = time.perf_counter()
    assert len(session.propose(4)) == 4
    assert time.perf_counter() - started >= 0.019
    cancel = CancelToken()
    cancel.cancel()
    session.sync(prompt)
    assert session.propose(4, cancel=cancel).tokens == []


def test_sampling_mode_gives_point_masses() -> None:
    prompt, _ = _reference(50)
    session = _model(0.5, n=50).open_session()
    session.sync(prompt)
    draft = session.propose(3, SamplingParams(temperature=0.7))
    assert draft.dists is not None and len(draft.dists) == 3
    for token, dist in zip(draft.tokens, draft.dists, strict=True):
        assert dist.prob_of(token) == 1.0


def test_folder_round_trip(tmp_path) -> None:
    prompt, truth = _reference(30)
    config = OracleConfig(acceptance=0.7, delay_ms=2.0, seed=5, vocab_size=VOCAB)
    folder = write_oracle_folder(tmp_path / "oracle", [(prompt, truth)], config)
    assert is_oracle_folder(folder) and not is_oracle_folder(tmp_path)
    loaded = OracleDraftModel.from_folder(folder)
    assert loaded.config == config
    assert loaded.references[0].continuation == tuple(truth)
    with pytest.raises(ValueError):
        OracleConfig(acceptance=1.5)
