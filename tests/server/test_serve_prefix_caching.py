"""`kvledger serve --no-enable-prefix-caching` (vLLM's flag; serve had no way to turn prefix caching off):
the engine it builds caches no prefix, so a repeated prompt hits nothing, and the banner says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from .inproc import KEYS, running

pytestmark = pytest.mark.model

PROMPT = "Every block a request holds is in the ledger, and so is every promise. " * 4


def _cached(srv, prompt: str) -> int:  # noqa: ANN001
    resp = srv.post("/v1/completions", {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1,
                                        "temperature": 0}, key=KEYS["acme"])
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("flag, hits", [("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False)])
def test_serve_turns_prefix_caching_on_and_off(tmp_path: Path, flag: str, hits: bool) -> None:
    with running(tmp_path, "--pool-blocks", "96", flag) as srv:
        assert ("prefix caching off" in " ".join(srv.lines)) is not hits
        _cached(srv, PROMPT)
        assert (_cached(srv, PROMPT) > 0) is hits  # the same prompt again, same tenant
        srv.wait_idle()
