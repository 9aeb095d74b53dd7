"""scripts/one_slot_ceiling.py: a one-slot verify priced on a regime file."""

from __future__ import annotations

import pytest

from proxy.bench.regime.regime_file import load_regime
from tests.support.scripts import load_script


def test_a_round_is_one_request_and_one_decode_of_k_plus_one_tokens():
    script = load_script("one_slot_ceiling")
    regime = load_regime("strix-halo-vulkan-32b")
    # 8 tokens: the last batch on Vulkan's matrix-vector path (fixed 124.89 ms in the file)
    expected = regime.host.request_ms(1, 519) + 124.89 + 1.28 * 519 / 1000
    assert script.one_slot_round_ms(regime, 7, 512) == pytest.approx(expected)


def test_the_vulkan_ceiling_stops_at_the_matrix_vector_edge(capsys):
    script = load_script("one_slot_ceiling")
    assert script.main(["strix-halo-vulkan-32b", "--acceptance", "0.8", "--draft-ms", "11"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "vulkan-32b" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # ideal: the free draft's best k is 7 (8 tokens); 9 tokens cost ~3.4 steps
    assert cells[3].endswith("(7)")
    assert 2.9 < float(cells[4]) < 3.2
