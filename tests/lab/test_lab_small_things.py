"""Issue 33's lab points: the compressed-KV section describes what the lab shows (it said "not available yet"),
and the decision checker gives full marks to a correct decision under every admission policy."""

from __future__ import annotations

import itertools

import pytest

from kvledger.weblab import lesson
from kvledger.weblab.app import SEED_CONTROLS
from kvledger.weblab.inputs import LabInput


def test_the_compressed_section_points_at_what_the_lab_shows(client, seed):
    page = client.get("/").text
    section = page[page.index('<section id="compressed"'):]
    section = section[:section.index("</section>")]
    assert "not available" not in section.lower()
    assert "int8" in section and 'href="#exercise"' in section
    # What it promises holds: the exercise offers int8 and the same pool then holds 451 pages instead of 256
    # (int8-token 504).
    assert "int8" in client.get("/api/meta").json()["kv_dtypes"]
    plain = client.post("/api/admit", json=seed).json()
    packed = client.post("/api/admit", json=dict(seed, kv_dtype="int8")).json()
    assert (plain["pool_blocks"], packed["pool_blocks"]) == (256, 451) and "451 pages instead of 256" in section
    token = client.post("/api/admit", json=dict(seed, kv_dtype="int8-token")).json()
    assert token["pool_blocks"] == 504 and "1,040&nbsp;KiB and 504 pages" in section


@pytest.mark.parametrize("policy", ["full", "incremental", "predicted"])
def test_the_model_answer_gets_full_marks_under_every_policy(policy):
    """Under incremental the model answer said nothing about a shorter allowance, so it, and any correct answer
    that said the allowance changes nothing at admission, was marked missing a point."""
    for max_new, groups, requests in itertools.product((0, 129, 257), (1, 8), (3, 8)):
        inp = LabInput(**dict(SEED_CONTROLS, max_new=max_new, groups=min(groups, requests), requests=requests,
                              policy=policy))
        got = lesson.check_decision(inp, lesson.model_answer(inp)["text"])
        assert got["found"] == got["total"], (max_new, groups, requests,
                                              [i["key"] for i in got["items"] if not i["found"]])


def test_a_correct_incremental_decision_is_not_missing_a_point(client, seed):
    text = ("All 8 fit in one group and only 1 with eight trust groups. Each request is 145 pages; the 128 prefix "
            "pages are shared, and the eight need 136 pages held or promised. A shorter output allowance changes "
            "nothing at admission under incremental: only the next token is reserved.")
    got = client.post("/api/decision", json={"controls": dict(seed, policy="incremental"), "text": text}).json()
    assert (got["found"], got["total"]) == (6, 6), [i["key"] for i in got["items"] if not i["found"]]
    assert "changes nothing at admission" in got["model_answer"]
    assert "which fits the 256-page pool" not in got["model_answer"]  # 264 pages do not fit 256


@pytest.mark.parametrize("point", [
    "With max_new = 256 all eight fit.",
    "If the output drops to 256 tokens, all eight get in.",
    "Decreasing the allowance by one token admits the eighth.",
])
def test_the_shorter_allowance_point_is_found_however_it_is_put(client, seed, point):
    text = ("Admit 7 of the 8 in one group, 1 with eight trust groups: 145 pages each, 128 prefix pages shared, "
            "247 used and 9 left. " + point)
    got = client.post("/api/decision", json={"controls": seed, "text": text}).json()
    assert (got["found"], got["total"]) == (6, 6), [i["key"] for i in got["items"] if not i["found"]]


def test_pool_pages_alone_are_not_the_shorter_allowance_point(client, seed):
    text = "Admit 7 of the 8 in one group, 1 with eight trust groups: 145 pages each, 128 shared, 9 of 256 pages left."
    got = client.post("/api/decision", json={"controls": seed, "text": text}).json()
    assert {i["key"]: i["found"] for i in got["items"]}["shorter_allowance"] is False
