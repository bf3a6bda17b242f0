"""Each pathology injected on purpose into a real SmolLM2-135M run is named with the right kind and a
byte count within 10% of what was injected; a clean run names nothing."""

from __future__ import annotations

import pytest

from kvledger.runtime.measure.diagnostics import INJECTIONS, default_workload, run_diagnosis

pytestmark = pytest.mark.model
MiB = 1 << 20


def workload():
    # Two waves of three requests (prompts of 16..160 tokens, 8..16 new tokens, two tenants): every
    # request finishes, blocks go back to the free list while the second wave runs.
    return default_workload(6, max_prompt=160, max_new=16, wave=3, wave_gap=5)


def test_a_clean_run_names_nothing(smollm2_engine):
    run = run_diagnosis(workload(), engine=smollm2_engine())
    assert run.diagnosis.findings == []
    assert len(run.diagnosis.steps) >= 10
    # The seed's warning, observed: blocks went back to the free list; the allocator and the process did not move.
    [note] = run.diagnosis.notes
    assert "the pool's active blocks fell by" in note and "changes who owns it, not what is allocated" in note


@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_an_injected_pathology_is_named_with_its_bytes(smollm2_engine, name):
    engine = smollm2_engine()
    # Creation sites on for the retained tensor: the finding then names the line that made it.
    run = run_diagnosis(workload(), engine=engine, inject=name, inject_bytes=48 * MiB,
                        sites=name == "retained-tensor")
    [inj] = run.injections
    assert inj.step is not None and inj.injected_bytes >= MiB, f"{name} was not injected"
    kinds = [f.kind for f in run.diagnosis.findings]
    assert kinds == [inj.kind], f"{name}: expected exactly one {inj.kind}, got {kinds}"
    [finding] = run.diagnosis.findings
    assert abs(finding.bytes - inj.injected_bytes) <= 0.10 * inj.injected_bytes, (finding.bytes, inj.injected_bytes)
    assert finding.steps[0] == inj.step  # named at the step it happened
    assert finding.evidence and finding.summary
    if name == "pool-leak":
        engine.check()  # every conservation law holds: only the pool ledger sees the leak
        assert finding.evidence["orphans"][0]["id"] == inj.detail["sequence"]
    if name == "retained-tensor":
        row = finding.evidence["largest"][0]
        assert row["bytes"] == inj.injected_bytes
        assert f"key '{inj.detail['request']}' of RetainedTensor.cache" in row["held_by"]
        assert "diagnostics/inject.py" in row["site"] and row["site"].endswith(" in act")
        assert inj.detail["request"] in finding.requests
    if name == "peak":
        assert finding.evidence["step_shape"]["kind"] == "decode"
