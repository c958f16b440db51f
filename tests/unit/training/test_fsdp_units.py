"""How the trainer cuts a model into FSDP units (`training.fsdp.unit_layout`), against the rules the config states."""

from __future__ import annotations

from hybridrl.training.fsdp import unit_layout


def test_auto_by_size():
    assert unit_layout(28, 1_500_000_000) == (28, False)  # small: one unit, kept gathered
    assert unit_layout(28, 7_600_000_000) == (4, True)  # large: 7 units of 4, freed after forward


def test_explicit_settings_win():
    assert unit_layout(28, 1_500_000_000, layers_per_unit=1) == (1, False)
    assert unit_layout(28, 1_500_000_000, layers_per_unit=1, reshard_after_forward=True) == (1, True)
    assert unit_layout(28, 7_600_000_000, layers_per_unit=28) == (28, False)
    assert unit_layout(2, 1000, layers_per_unit=8) == (2, False)
