"""A sweep writes each run's report into a folder named after its settings: readable, and safe as a path."""

from __future__ import annotations

from kvledger.sim.report import _slug


def test_a_run_folder_keeps_the_settings_letters_and_replaces_the_rest() -> None:
    assert _slug({"model": "Llama 3.1/8B", "policy": "Full", "tp": 2}) == "model-Llama-3.1-8B_policy-Full_tp-2"
    assert _slug({}) == "base"
    assert len(_slug({"x": "A" * 500})) == 120
