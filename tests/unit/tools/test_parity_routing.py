"""The parity table's routing columns: flips counted per layer, and the verdict they explain."""

import numpy as np
import pytest

from expertax.tools.parity import routing as parity_routing
from expertax.tools.parity.layouts import parse_layout
from expertax.tools.parity.run import make_row
from expertax.tools.parity.table import format_row


def test_flips_count_changed_experts_per_layer_not_their_order():
    ref = np.array([[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]]])  # [L=2, B=1, T=2, K=2]
    got = ref.copy()
    got[0, 0, 0] = [1, 0]  # the same experts in another order: no flip
    assert parity_routing.count_flips(ref, got) == [0, 0]
    got[1, 0, 1] = [6, 9]  # one expert replaced in layer 1
    got[0, 0, 1] = [8, 9]  # both replaced in layer 0
    assert parity_routing.count_flips(ref, got) == [2, 1]
    with pytest.raises(ValueError, match="routing shapes differ"):
        parity_routing.count_flips(ref, got[:1])


def test_flips_cell():
    assert parity_routing.format_flips(None) == "-"
    assert parity_routing.format_flips([0, 0, 0]) == "0"
    assert parity_routing.format_flips([0, 0, 2, 1]) == "3 (0/0/2/1)"


OK_FLIPS = "yes (2 routing flips; within tolerance under the reference's routing: step 0's forward)"


def row(diff, flips=None, imposed=None):
    return {"max_abs_loss_diff": diff, "routing_flips": flips, "imposed_loss_diff": imposed}


@pytest.mark.parametrize(
    "r,ok,cell",
    [
        (row(1e-6), True, "yes"),
        (row(1e-6, [0, 0], 1e-6), True, "yes"),
        (row(1e-6, [0, 0], 1e-3), False, "NO (imposed routing out of tolerance)"),
        (row(1e-3), False, "NO"),
        (row(1e-3, [0, 0], 1e-6), False, "NO"),  # no flip: nothing explains the difference
        (row(1e-3, [0, 2]), False, "NO (2 routing flips; --impose-routing"),
        (row(1e-3, [0, 2], 1e-6), True, OK_FLIPS),
        (row(1e-3, [0, 2], 1e-3), False, "NO (out of tolerance with the reference's routing"),
    ],
)
def test_verdict(r, ok, cell):
    got_ok, got_cell = parity_routing.verdict(r, 1e-5)
    assert got_ok == ok and got_cell.startswith(cell)


def test_row_and_cells_from_probes():
    """make_row counts the flips against the reference's probe and the imposed |dloss|; rows
    without probes (pipelines, fakes) show `-`."""
    layout = parse_layout("sparse-padded-ep2")
    ref_chosen = np.zeros((2, 1, 1, 2), np.int32) + np.array([0, 1])
    got = ref_chosen.copy()
    got[1, 0, 0] = [0, 5]
    probes = [{"loss": 2.001, "chosen": got}, {"loss": 2.0000001, "chosen": got}]
    run = {"losses": [2.001], "tokens_per_s_per_device": 1.0, "probes": probes}
    r = make_row(layout, run, [2.0], {"loss": 2.0, "chosen": ref_chosen})
    assert r["routing_flips"] == [0, 1] and r["imposed_loss_diff"] == pytest.approx(1e-7, abs=1e-9)
    cells = format_row(r, 1e-5, [2.0])
    assert "| 1 (0/1) | 1.00e-07 | yes (1 routing flips; within tolerance under the" in cells
    plain = make_row(layout, {"losses": [2.0], "tokens_per_s_per_device": 1.0}, [2.0])
    assert plain["routing_flips"] is None
    assert format_row(plain, 1e-5, [2.0]).endswith("| 0.00e+00 | - | - | yes |")
