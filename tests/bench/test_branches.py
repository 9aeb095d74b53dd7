"""Near-tie branches: which positions count, and that the bench's reference phase
records what llama-server writes after each runner-up."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from npu_draft.oracle import OracleDraftModel
from proxy.bench.branches import greedy_top2, pick_branch_points
from proxy.bench.client import exact_tokens
from proxy.bench.neartie import NEAR_TIE_LOGIT_GAP, top2_gap
from proxy.bench.runner import BenchOptions, BenchSession
from tests.conftest import SERVER_THREADS


def test_branch_points_are_the_closest_ties_under_the_margin() -> None:
    continuation = [10, 11, 12, 13, 14]
    top2 = [
        ([10, 20], 0.015),
        ([21, 11], 0.001),  # the reference took the runner-up of the probe: still a tie
        ([12, 22], 0.5),  # no near-tie
        ([23, 24], 0.0),  # the reference's token is not among the top-2
        ([14, 25], 0.005),
    ]
    points = pick_branch_points(continuation, top2, NEAR_TIE_LOGIT_GAP, limit=2)
    assert [(p.position, p.runner_up) for p in points] == [(1, 21), (4, 25)]
    everything = pick_branch_points(continuation, top2, NEAR_TIE_LOGIT_GAP, limit=10)
    assert [p.position for p in everything] == [1, 4, 0]
    assert pick_branch_points(continuation, top2, NEAR_TIE_LOGIT_GAP, limit=0) == []
    assert pick_branch_points(continuation, top2, 0.0, limit=10) == []
    assert [p.position for p in pick_branch_points(continuation, top2, 1.0, 10)] == [1, 4, 0, 2]


def _branching_bench(
    llama_server_bin: Path, demo_models: Path, tmp_path: Path, n_predict: int, **branching
) -> BenchSession:
    """A plain-and-oracle bench of one prompt on the demo target, recording branches."""
    options = BenchOptions(
        target=demo_models / "target.gguf",
        modes=["plain", "oracle"],
        n_predict=n_predict,
        prompt_ids=["chat-explain"],
        threads=int(SERVER_THREADS),
        llama_server=llama_server_bin,
        work_dir=tmp_path,
        ceiling_ks=[],
        # near-ties are rare on the tiny model: every position counts, the closest first
        branch_margin=1e9,
        **branching,
    )
    return BenchSession(options)


@pytest.mark.server
@pytest.mark.slow
async def test_reference_phase_records_what_llama_server_writes_after_each_runner_up(
    llama_server_bin: Path, demo_models: Path, start_server, tmp_path: Path
) -> None:
    n_predict, n_branches = 12, 3
    bench = _branching_bench(
        llama_server_bin, demo_models, tmp_path, n_predict, oracle_branches=n_branches
    )
    # a fresh connection per request, as the bench has: llama-server may close one
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        prompts, outputs = await bench._reference_phase(session, None)
        (prompt,) = prompts
        plain = outputs[prompt.id]
        assert len(plain.branches) == n_branches
        server = await start_server(demo_models / "target.gguf")
        url = server.base_url
        probed, top2 = await greedy_top2(session, url, prompt.tokens, n_predict)
        assert probed == plain.tokens
        gaps = [gap for _, gap in top2]
        for branch in plain.branches:
            before = [*prompt.tokens, *plain.tokens[: branch.position]]
            ids, _ = await top2_gap(session, url, before)
            assert set(ids) == {plain.tokens[branch.position], branch.token}
            left = n_predict - branch.position - 1
            expected = await exact_tokens(session, url, [*before, branch.token], left)
            assert list(branch.continuation) == expected
        # the closest ties, as this server sees them (a float's noise allowed)
        chosen = {b.position for b in plain.branches}
        others = [g for i, g in enumerate(gaps) if i not in chosen]
        assert max(gaps[i] for i in chosen) <= min(others) + 1e-3
    # the JSON lists them, and the oracle's folder carries them
    (record,) = bench.references
    assert [b["position"] for b in record["branches"]] == [b.position for b in plain.branches]
    folders = bench._oracle_folders(None, prompts, outputs, [(None, 0.0)])
    model = OracleDraftModel.from_folder(next(iter(folders.values())))
    paths = model.references[0].branches
    assert [p.fork for p in paths] == [b.position for b in plain.branches]
    assert [p.continuation[p.fork + 1 :] for p in paths] == [b.continuation for b in plain.branches]


@pytest.mark.server
@pytest.mark.slow
async def test_sub_branches_record_what_llama_server_writes_after_a_branchs_own_runner_up(
    llama_server_bin: Path, demo_models: Path, start_server, tmp_path: Path
) -> None:
    n_predict = 10
    bench = _branching_bench(
        llama_server_bin, demo_models, tmp_path, n_predict, oracle_branches=2,
        oracle_sub_branches=1,
    )  # fmt: skip
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        prompts, outputs = await bench._reference_phase(session, None)
        (prompt,) = prompts
        plain = outputs[prompt.id]
        first, subs = plain.branches[:2], plain.branches[2:]
        assert len(subs) == 2  # one per branch (each has tokens after its fork)
        url = (await start_server(demo_models / "target.gguf")).base_url
        (record,) = bench.references
        for parent, sub, entry in zip(first, subs, record["branches"][2:], strict=True):
            # a sub-branch leaves the reference where its branch does, then its branch
            assert (sub.position, sub.token) == (parent.position, parent.token)
            q = entry["position"]
            assert entry["within"] == parent.position and 0 <= q < len(parent.continuation)
            assert sub.continuation[:q] == parent.continuation[:q]
            assert sub.continuation[q] != parent.continuation[q]
            fork = [*prompt.tokens, *plain.tokens[: parent.position], parent.token,
                    *sub.continuation[: q + 1]]  # fmt: skip
            left = n_predict - parent.position - 1 - q - 1
            assert list(sub.continuation[q + 1 :]) == (
                await exact_tokens(session, url, fork, left) if left > 0 else []
            )
    assert all("within" not in b for b in record["branches"][:2])
    folders = bench._oracle_folders(None, prompts, outputs, [(None, 0.0)])
    model = OracleDraftModel.from_folder(next(iter(folders.values())))
    assert [p.fork for p in model.references[0].branches] == [b.position for b in plain.branches]
