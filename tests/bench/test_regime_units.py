"""The regime server's parts on their own: regime files, charges, KV placement, the
command line and llama-server's response_fields."""

from __future__ import annotations

import tomllib

import pytest

from proxy.bench.regime.__main__ import parser, split_known
from proxy.bench.regime.build import (
    decode_table,
    joined_rows,
    new_shape_ms,
    slot_fit,
    span_slopes,
)
from proxy.bench.regime.engine import ShapeHistory
from proxy.bench.regime.http_api import _pick
from proxy.bench.regime.kv_pool import N_PAD, KvPool, padded_span
from proxy.bench.regime.prompt_cache import PromptCache, common_prefix
from proxy.bench.regime.regime_file import (
    REGIMES_DIR,
    DecodeCost,
    HostCost,
    SlotCost,
    load_regime,
    parse_regime,
)


def test_decode_cost_interpolates_between_points_and_extends_the_ends() -> None:
    cost = DecodeCost(tokens=(1, 9, 17), fixed_ms=(10.0, 30.0, 34.0), per_kcell_ms=(1, 1, 3))
    assert cost.ms(1, 0) == 10.0
    assert cost.ms(5, 0) == pytest.approx(20.0)
    assert cost.ms(13, 2000) == pytest.approx(32.0 + 2 * 2.0)
    assert cost.ms(25, 0) == pytest.approx(38.0)  # the last segment's slope goes on


def test_decode_cost_refuses_a_table_that_does_not_rise() -> None:
    with pytest.raises(ValueError, match="rise"):
        DecodeCost(tokens=(4, 2), fixed_ms=(1.0, 2.0), per_kcell_ms=(0.0, 0.0))
    with pytest.raises(ValueError, match="one value each"):
        DecodeCost(tokens=(1, 2), fixed_ms=(1.0,), per_kcell_ms=(0.0, 0.0))


def test_host_cost_per_request_prompt_and_ids() -> None:
    host = HostCost(per_request_ms=1.0, per_prompt_ms=0.5, per_kid_ms=2.0)
    assert host.request_ms(n_prompts=4, n_ids=3000) == pytest.approx(1.0 + 2.0 + 6.0)


def test_a_regime_without_sources_is_refused() -> None:
    data = tomllib.loads((REGIMES_DIR / "h200-cuda-14b-f16.toml").read_text())
    del data["host"]["source"]
    with pytest.raises(ValueError, match="no source"):
        parse_regime(data)


@pytest.mark.parametrize("path", sorted(REGIMES_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_regime_names_its_sources(path) -> None:
    regime = load_regime(path.stem)
    assert regime.name == path.stem
    assert {"decode", "host", "slots"} <= set(regime.sources)
    assert regime.plain_step_ms and regime.step_ms(512) == pytest.approx(
        regime.plain_step_ms, rel=0.1
    )
    if path.stem.startswith("strix-halo"):  # the seed's rows, and what nobody measured
        assert regime.assumptions
        assert regime.reference["plain_tok_s"] > 0


def test_the_strix_halo_regimes_charge_the_vulkan_matrix_vector_edge() -> None:
    """b11434's Vulkan backend: up to 8 tokens on the matrix-vector path, 9 above it
    (the seed: a 7-token batch ~1.3 plain steps, a 9-token batch ~3.4)."""
    regime = load_regime("strix-halo-vulkan-32b")
    step = regime.decode.ms(1, 512)
    assert regime.decode.ms(7, 512) == pytest.approx(1.3 * step, rel=0.02)
    assert regime.decode.ms(9, 512) == pytest.approx(3.4 * step, rel=0.02)
    assert regime.decode.ms(8, 512) < 1.4 * step


def test_kv_pool_places_from_the_head_and_restarts_low_when_much_is_free() -> None:
    pool = KvPool(n_ctx=2048, n_seq=4, unified=True)
    pool.add(0, 0, 300)
    pool.add(1, 0, 300)
    assert pool.n_kv(0) == 768  # 600 cells used, padded to 256
    pool.remove(0, 0)  # the head moves back to the first freed cell
    pool.add(2, 0, 100)
    assert pool.cells_of(2) == 100
    assert pool.n_kv(2) == 768  # sequence 1 still sits at cells 300-599
    pool.remove(1, 0)
    assert pool.n_kv(2) == N_PAD


def test_kv_pool_partial_remove_keeps_the_prefix() -> None:
    pool = KvPool(n_ctx=1024, n_seq=2, unified=True)
    pool.add(0, 0, 100)
    pool.remove(0, 60)
    assert pool.cells_of(0) == 60
    assert pool.free_cells() == 1024 - 60


def test_kv_pool_without_kvu_gives_each_slot_its_share() -> None:
    pool = KvPool(n_ctx=1024, n_seq=4, unified=False)
    pool.add(3, 0, 256)
    assert pool.free_cells(3) == 0
    assert pool.free_cells(0) == 256


def test_llama_server_command_lines_split_into_read_and_ignored_options() -> None:
    line = "-m t.gguf --port 5 -np 4 -c 8192 --kv-unified-per-slot 2048 -kvu "
    line += "--no-cache-idle-slots -cram 0 --metrics --slot-save-path /s -ngl 99 -fa on -md d.gguf"
    argv = line.split(" ")
    known, ignored = split_known(argv, parser())
    args = parser().parse_args(known)
    assert (args.model, args.parallel, args.ctx_size, args.kv_unified) == ("t.gguf", 4, 8192, True)
    assert args.kv_unified_per_slot == 2048 and args.metrics and args.cache_ram == 0
    assert ignored == ["--no-cache-idle-slots", "-ngl", "99", "-fa", "on", "-md", "d.gguf"]
    assert parser().parse_args([]).cache_ram == 8192  # b11434's default: the prompt cache is on


def test_response_fields_are_flat_paths_in_the_order_asked() -> None:
    payload = {"index": 2, "tokens": [5], "timings": {"cache_n": 7, "prompt_n": 1}}
    picked = _pick(payload, ["timings/prompt_n", "tokens", "missing/path"])
    assert list(picked.items()) == [("timings/prompt_n", 1), ("tokens", [5])]
    assert _pick(payload, None) is payload


@pytest.mark.parametrize(
    ("a", "b", "length"),
    [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 9, 3], 1),
     ([5] * 1000 + [1], [5] * 1000 + [2], 1000), ([7, 8], [8, 7], 0)],
)  # fmt: skip
def test_common_prefix(a: list[int], b: list[int], length: int) -> None:
    assert common_prefix(a, b) == length


def test_rows_e_against_d_give_the_span_cost_of_a_rounds_batch() -> None:
    """The same round with every idle slot full (e) against them empty (d): only the
    span differs, so the extra server ms over the extra cells is attention's slope."""
    d = {"part": "d", "variant": "v", "context": 4096, "k": 3, "np": 7, "tokens_per_round": 11,
         "server_ms_median": 20.0}  # fmt: skip
    e = {**d, "part": "e", "idle_slots": "full", "server_ms_median": 23.0}
    result = {"rows": [d, e]}
    cells = padded_span(7 * (4096 + 11)) - padded_span(4 * (4096 + 11))
    assert span_slopes(result, "v", 4096) == {11: pytest.approx(3.0 / cells)}
    assert span_slopes(result, "v", 512) == {}


def test_a_decode_replays_from_the_third_of_one_shape_in_a_row() -> None:
    """ggml's CUDA graph warm-up: the first decode of a shape runs, the second captures,
    the third replays; another shape (or another output count) starts over."""
    shapes = ShapeHistory()
    a, b = ((17, 5, 3328),), ((16, 4, 3328),)
    assert [shapes.new(a, 5) for _ in range(4)] == [1, 1, 0, 0]
    assert [shapes.new(b, 4), shapes.new(a, 5), shapes.new(a, 5), shapes.new(a, 5)] == [1, 1, 1, 0]
    assert [shapes.new(a, 4), shapes.new(a, 4), shapes.new(a, 4)] == [1, 1, 0]


def test_rows_m_against_h_give_the_new_shape_charge() -> None:
    """Rows h repeat one shape; row m changes it every round: the charge is m's server
    ms beyond the mean of h's at the same k and context (none without rows m)."""
    h = [{"part": "h", "variant": "v", "context": 512, "k": 2, "accepted": j,
          "server_ms_median": ms} for j, ms in enumerate((15.0, 15.5, 16.0))]  # fmt: skip
    m = {"part": "m", "variant": "v", "context": 512, "k": 2, "server_ms_median": 18.0}
    assert new_shape_ms({"rows": [*h, m]}, "v") == pytest.approx(2.5)
    assert new_shape_ms({"rows": h}, "v") is None
    cheaper = {**m, "server_ms_median": 15.0}
    assert new_shape_ms({"rows": [*h, cheaper]}, "v") == 0.0


def test_a_later_file_adds_parts_and_replaces_none() -> None:
    first = [{"part": "a", "context": 512, "ms_median": 9.2}, {"part": "f", "context": 512}]
    later = [{"part": "a", "context": 512, "ms_median": 9.9}, {"part": "h", "k": 4},
             {"part": "m", "k": 4}]  # fmt: skip
    rows = joined_rows(first, later, {r["part"] for r in first})
    assert [r["part"] for r in rows] == ["a", "f", "h", "m"]
    assert rows[0]["ms_median"] == 9.2


def test_the_prompt_cache_saves_a_pushed_out_prompt_and_gives_it_back() -> None:
    cache = PromptCache(SlotCost(save_ms_per_ktoken=100.0, restore_ms_per_ktoken=10.0))
    first, other = list(range(1000)), list(range(5000, 5500))
    assert cache.save(first) == pytest.approx(100.0)
    assert cache.save(first[:500]) == 0.0  # already held inside a longer prompt
    assert cache.load(other, [*other, 1]) == (None, 0.0)  # the slot's own cache suits better
    assert cache.save(other) == pytest.approx(50.0)
    loaded, charge = cache.load(other, [*first, 7])
    assert loaded == first and charge == pytest.approx(10.0)
    assert cache.load(other, [*first, 7]) == (None, 0.0)  # a load takes the entry out
    assert cache.load([], list(range(5000, 5100)) + [9] * 400) == (None, 0.0)  # keeps < 1/4


def _cold_rows(part: str, context: int, server_ms: float, save: float, restore: float) -> dict:
    return {
        "part": part, "variant": "v", "context": context, "np": 9,
        "server_ms_median": server_ms,
        "samples": [{"save_wall_ms": save, "restore_wall_ms": restore}],
    }  # fmt: skip


def test_rows_g_against_f_give_the_span_cost_of_a_prefill_and_of_slot_actions() -> None:
    """A cold prefill and a copy with every other slot full (g) against the same alone
    (f): the extra ms over the other slots' cells is the cost per cell of the span."""
    f_low, f_high = (
        _cold_rows("f", 512, 37.0, 77.0, 18.0),
        _cold_rows("f", 4096, 304.0, 616.0, 146.0),
    )
    g_high = {
        **_cold_rows("g", 4096, 304.0 + 8 * 8 * 4096 * 0.002, 616.0 + 32.768, 146.0),
        "idle_slots": "full",
    }
    a = [
        {"part": "a", "variant": "v", "context": c, "ms_median": 9.4 + c / 1e5} for c in (512, 4096)
    ]
    result = {
        "rows": [*a, f_low, f_high, g_high],
        "options": {"plain_tokens": 64, "warmup": 1, "repeats": 4},
    }
    decode, _, prefill = decode_table(result, "v")
    assert decode.tokens[-1] == 512
    assert decode.per_kcell_ms[-1] == pytest.approx(2.0)  # ms per 1000 cells of span
    assert "g against f" in prefill["prefill ms"]
    slots = slot_fit({"rows": [f_low, f_high, g_high]}, "v")
    assert slots["save_ms_per_span_kcell"] == pytest.approx(1.0, abs=1e-3)
    assert slots["restore_ms_per_span_kcell"] == 0.0
    cost = SlotCost(save_ms_per_ktoken=150.0, save_ms_per_span_kcell=1.0)
    assert cost.save_ms(4096, span=9 * 4096) == pytest.approx(150.0 * 4.096 + 8 * 4.096)
    assert cost.save_ms(4096) == pytest.approx(150.0 * 4.096)


def test_rows_i_give_the_plain_servers_prompt_cache_rate() -> None:
    """A plain server's new prompt while its slot held another (rows i) against the
    same on an emptied slot: the prompt cache's copy, charged per token from then on
    instead of the slot-file save rate."""
    from proxy.bench.regime.prompt_cache import PromptCache

    f_rows = [_cold_rows("f", 512, 37.0, 93.0, 18.0), _cold_rows("f", 4096, 304.0, 745.0, 146.0)]
    i_rows = [
        {"part": "i", "variant": "v", "context": c,
         "samples": [{"save_ms": ms}, {"save_ms": 999.0}, {"save_ms": ms}]}
        for c, ms in ((512, 70.0), (4096, 471.0))
    ]  # fmt: skip
    slots = slot_fit({"rows": [*f_rows, *i_rows]}, "v")
    assert slots["prompt_cache_save_ms_per_ktoken"] == pytest.approx(471.0 / 4.096, abs=1e-3)
    assert "prompt_cache_save_ms_per_ktoken" not in slot_fit({"rows": f_rows}, "v")
    charged = PromptCache(SlotCost(save_ms_per_ktoken=182.0, prompt_cache_save_ms_per_ktoken=115.0))
    assert charged.save(list(range(4096))) == pytest.approx(115.0 * 4.096)
    assert PromptCache(SlotCost(save_ms_per_ktoken=182.0)).save([1] * 1000) == pytest.approx(182.0)


def test_a_one_slot_row_is_taken_warm_not_at_the_median_of_a_slow_start() -> None:
    """H200, Vulkan, 512: the 3-token batch took 40 ms four times, then 13.7 four times
    (the backend's first uses of a batch shape); the rounds repeat their shapes, so the
    file charges the warm half, not the median of both."""
    from proxy.bench.regime.build import _warm_server_ms

    slow_start = [40.0] * 4 + [13.7] * 4
    row = {"server_ms_median": 26.9, "samples": [{"server_ms": ms} for ms in slow_start]}
    assert _warm_server_ms(row) == pytest.approx(13.7)
    assert _warm_server_ms({"server_ms_median": 26.9, "samples": []}) == 26.9
