"""The oracle drafter: deterministic, acceptance close to the chosen a, and harmless
off its reference path."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from npu_draft.oracle import (
    ORACLE_FILE,
    Branch,
    OracleConfig,
    OracleDraftModel,
    drafted_token,
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


# --- branches: the target's continuation after a near-tie's runner-up -----------------


def _branched(a: float, fork: int = 30, n: int = 120) -> tuple[OracleDraftModel, list[int]]:
    """A model whose reference has one branch at `fork`; returns it and the branch's
    whole continuation (the reference's up to `fork`, the runner-up, the rest)."""
    prompt, truth = _reference(n)
    rng = np.random.default_rng(7)
    runner_up = (truth[fork] + 1) % VOCAB
    after = rng.integers(0, VOCAB, n - fork - 1).tolist()
    config = OracleConfig(acceptance=a, seed=3, vocab_size=VOCAB)
    model = OracleDraftModel([(prompt, truth, [Branch(fork, runner_up, tuple(after))])], config)
    return model, [*truth[:fork], runner_up, *after]


def _follow(model: OracleDraftModel, prompt: list[int], truth: list[int], k: int) -> list[int]:
    """Greedy rounds where the target writes `truth`: the draft length of each round."""
    session = model.open_session()
    committed = list(prompt)
    lengths = []
    while len(committed) - len(prompt) < len(truth):
        done = len(committed) - len(prompt)
        session.sync(committed)
        draft = session.propose(min(k, len(truth) - done - 1))
        run = 0
        while run < len(draft) and draft.tokens[run] == truth[done + run]:
            run += 1
        committed += truth[done : done + run + 1]
        lengths.append(len(draft))
    return lengths


def test_a_flip_at_a_branch_point_is_followed() -> None:
    model, branch_truth = _branched(1.0)
    prompt = list(model.references[0].prompt)
    # the target flips the tie: every round but the last (nothing left to draft) drafts
    lengths = _follow(model, prompt, branch_truth, k=3)
    assert all(n > 0 for n in lengths[:-1])
    # without the branch the oracle falls off its path at the flip and drafts nothing
    bare = OracleDraftModel([(prompt, model.references[0].continuation)], model.config)
    assert sum(n == 0 for n in _follow(bare, prompt, branch_truth, k=3)) > 20


def test_a_second_flip_inside_a_branch_is_followed_by_its_sub_branch() -> None:
    """A sub-branch (`--oracle-sub-branches`) is a branch of the reference that shares
    its branch's fork and leaves it later: a run that flips there stays on a path."""
    model, branch_truth = _branched(1.0, fork=30)
    ref = model.references[0]
    prompt = list(ref.prompt)
    branch = Branch(30, branch_truth[30], tuple(branch_truth[31:]))
    q = 20  # into the branch's continuation
    rng = np.random.default_rng(11)
    tail = rng.integers(0, VOCAB, len(branch.continuation) - q - 1).tolist()
    sub_after = (*branch.continuation[:q], (branch.continuation[q] + 1) % VOCAB, *tail)
    sub = Branch(30, branch.token, sub_after)
    twice = [*branch_truth[:30], branch.token, *sub_after]
    with_sub = OracleDraftModel([(prompt, ref.continuation, [branch, sub])], model.config)
    assert all(n > 0 for n in _follow(with_sub, prompt, twice, k=3)[:-1])
    # without it, the run falls off every path at the second flip
    assert sum(n == 0 for n in _follow(model, prompt, twice, k=3)) > 20
    # and a run on the branch still drafts the branch's token at the second tie
    session = with_sub.open_session()
    session.sync([*prompt, *branch_truth[: 31 + q]])
    assert session.propose(1).tokens == [branch.continuation[q]]


def test_the_reference_owns_the_sequence_up_to_the_branch_point() -> None:
    model, branch_truth = _branched(1.0, fork=30)
    ref = model.references[0]
    session = model.open_session()
    # take the branch first, so the session sits on it
    session.sync([*ref.prompt, *branch_truth[:40]])
    assert session.propose(2).tokens == branch_truth[40:42]
    # then a sequence at the branch point: the reference's token, as plain wrote it
    session.sync([*ref.prompt, *ref.continuation[:30]])
    assert session.propose(2).tokens == list(ref.continuation[30:32])


def test_branch_verdicts_are_the_references_before_the_fork_and_salted_after() -> None:
    model, branch_truth = _branched(0.5, fork=60, n=400)
    ref, path = model.references[0], model.references[0].branches[0]
    config = model.config
    before = [drafted_token(config, ref, i) for i in range(60)]
    assert before == [drafted_token(config, path, i) for i in range(60)]
    # after the fork: the branch's own verdicts, not a copy of the reference's
    verdicts = [drafted_token(config, path, i) == branch_truth[i] for i in range(61, 400)]
    main = [drafted_token(config, ref, i) == ref.continuation[i] for i in range(61, 400)]
    assert verdicts != main
    assert 0.4 < sum(verdicts) / len(verdicts) < 0.6
    assert verdicts == [
        drafted_token(config, path, i) == branch_truth[i] for i in range(61, 400)
    ]  # a pure function of the position


def test_off_every_recorded_path_proposes_nothing() -> None:
    model, branch_truth = _branched(1.0, fork=30)
    ref = model.references[0]
    session = model.open_session()
    other = (ref.continuation[30] + 2) % VOCAB  # neither the reference's nor the runner-up
    session.sync([*ref.prompt, *ref.continuation[:30], other])
    assert len(session.propose(4)) == 0
    # on the branch, then off it
    wrong = (branch_truth[50] + 1) % VOCAB
    session.sync([*ref.prompt, *branch_truth[:50], wrong])
    assert len(session.propose(4)) == 0
    session.sync([*ref.prompt, *branch_truth[:50]])
    assert session.propose(4).tokens == branch_truth[50:54]


def test_a_branch_must_leave_the_reference() -> None:
    prompt, truth = _reference(20)
    with pytest.raises(ValueError):
        OracleDraftModel([(prompt, truth, [Branch(5, truth[5], (1, 2))])])
    with pytest.raises(ValueError):
        OracleDraftModel([(prompt, truth, [Branch(20, 1, (1, 2))])])


def test_branches_round_trip_and_the_old_format_loads(tmp_path) -> None:
    model, branch_truth = _branched(0.7, fork=30)
    ref = model.references[0]
    branch = Branch(30, branch_truth[30], tuple(branch_truth[31:]))
    folder = write_oracle_folder(
        tmp_path / "new", [(ref.prompt, ref.continuation, [branch])], model.config
    )
    loaded = OracleDraftModel.from_folder(folder)
    assert loaded.references[0].branches[0].continuation == tuple(branch_truth)
    old = json.loads((folder / ORACLE_FILE).read_text())
    old["references"] = [entry[:2] for entry in old["references"]]
    (folder / ORACLE_FILE).write_text(json.dumps(old))
    reloaded = OracleDraftModel.from_folder(folder)
    assert reloaded.references[0].continuation == ref.continuation
    assert reloaded.references[0].branches == ()
