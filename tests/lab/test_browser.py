"""The lab in a real browser: Debian's `chromium`, headless, driven by Playwright for Python against
`kvledger lab` on a free loopback port. A learner predicts, reveals, changes the output allowance, writes a
decision, answers the quiz, reloads -- and finds the progress kept. A screenshot of each stage is saved
under reports/weblab-browser/ (not committed).

Playwright's own browser download (`playwright install`) is never used: the browser is the Debian package,
installed by `.ci/run` / `make test` when missing; the ``browser`` fixture (conftest.py) finds it, or skips
these tests with one line when there is none.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from playwright.sync_api import Page, expect

SHOTS = Path(__file__).resolve().parents[2] / "reports" / "weblab-browser"


def _shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _panel(page: Page, groups: int):
    return page.locator(f"#panels article.panel[data-groups='{groups}']")


def test_a_learner_runs_the_prefix_ownership_lab(lab_server, browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    requested: list[str] = []
    problems: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.set_default_timeout(20_000)

    page.goto(lab_server.url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.locator("#c-max_new")).to_have_value("257")
    expect(page.locator("#run")).to_be_disabled()  # the ledger runs after the prediction
    expect(page.locator("#revealed")).to_be_hidden()
    _shot(page, "1-start")

    # (1) Predict: 145 pages each; one group 264 needed, 7 admitted; eight groups 1,160 needed, 1 admitted.
    for field, value in (("blocks_per_request", "145"), ("one_group_needed", "264"), ("one_group_admitted", "7"),
                         ("isolated_needed", "1160"), ("isolated_admitted", "1")):
        page.get_by_label(re.compile(
            {"blocks_per_request": "^Pages one request needs",
             "one_group_needed": "^One trust group: pages all",
             "one_group_admitted": "^One trust group: requests admitted",
             "isolated_needed": "^8 trust groups: pages all",
             "isolated_admitted": "^8 trust groups: requests admitted"}[field])).fill(value)
    _shot(page, "2-predicted")

    # (2) Reveal, from the keyboard.
    page.locator("#reveal").focus()
    page.keyboard.press("Enter")
    expect(page.locator("[data-testid=score-total]")).to_have_text("Your prediction: 5 of 5 right.")
    one, eight = _panel(page, 1), _panel(page, 8)
    expect(one.locator("[data-testid=panel-summary]")).to_have_text(
        "7 of 8 admitted using 247 pages (128 live + 119 promised); 9 left to promise.")
    expect(one.locator("[data-testid=panel-pages]")).to_contain_text("145 pages per request = 128 shared-prefix + 17 "
                                                                      "private; all 8 together need 264")
    expect(eight.locator("[data-testid=panel-summary]")).to_contain_text("1 of 8 admitted using 145 pages")
    expect(eight.locator("[data-testid=panel-pages]")).to_contain_text("all 8 together need 1,160")
    expect(page.locator("#arithmetic")).to_contain_text("Request pages: ceil((2,048 + 257) / 16) = 145 pages")
    expect(page.locator("#arithmetic")).to_contain_text("128 + 7 x 17")
    # The block map: one cell per block, each with a text label as well as a colour.
    assert one.locator(".blockmap .cell").count() == 256
    assert one.locator(".blockmap .cell[data-state=shared]").count() == 128
    assert one.locator(".blockmap .cell[data-state=promised]").count() == 119
    assert one.locator(".blockmap .cell[data-state=free]").count() == 9
    assert one.locator(".blockmap .cell.slack").count() == 7
    assert set(one.locator(".blockmap .cell").all_inner_texts()) == {"S", "p", "\u00b7"}
    expect(one.locator("[data-testid=count-shared]")).to_have_text(re.compile(r": 128$"))
    assert one.locator("tr[data-outcome=admitted]").count() == 7
    expect(one.locator("tr[data-outcome=not_now]")).to_contain_text("only 9 can be promised")
    assert eight.locator("tr[data-outcome=admitted]").count() == 1
    _shot(page, "3-revealed")

    # (3) Change one control: the output allowance, 257 -> 129. All eight fit: 137 pages each, 200 in all.
    page.get_by_label("Output allowance (tokens)").fill("129")
    page.locator("#run").click()
    expect(one.locator("[data-testid=panel-summary]")).to_have_text(
        "8 of 8 admitted using 200 pages (128 live + 72 promised); 56 left to promise.")
    expect(one.locator("[data-testid=panel-pages]")).to_contain_text("137 pages per request")
    changed = page.locator("#compare tr.changed")
    expect(changed.filter(has_text="One trust group: admitted")).to_contain_text("78changed")
    expect(changed.filter(has_text="One trust group: pages per request")).to_contain_text("145137")
    expect(eight.locator("[data-testid=panel-summary]")).to_contain_text("1 of 8 admitted")
    _shot(page, "4-changed-allowance")

    # (4) The written decision, checked for the key numbers, then the model answer.
    decision = ("Admit at most 7 in one trust group: 128 shared pages + 7 x 17 private = 247, leaving 9. Each "
                "request needs 145 pages. With eight trust groups only 1 fits. A shorter output allowance "
                "(129 tokens) lets all eight in.")
    page.get_by_label(re.compile("^Your decision for this pool")).fill(decision)
    page.locator("#check-decision").click()
    expect(page.locator("[data-testid=decision-score]")).to_have_text("Your decision mentions 6 of 6 key points.")
    expect(page.locator("#model-answer")).to_contain_text("admit at most 7 of the 8 requests")
    _shot(page, "5-decision")

    # Check yourself: answer first (the reveal button stays disabled until then), then reveal.
    seed_pages = page.locator("#quiz-seed-pages")
    expect(seed_pages.locator("button.reveal-answer")).to_be_disabled()
    seed_pages.locator("input[type=radio]").first.focus()
    page.keyboard.press("Space")  # 144
    page.keyboard.press("ArrowRight")  # 145
    expect(seed_pages.locator("input[value='145']")).to_be_checked()
    seed_pages.locator("button.reveal-answer").click()
    expect(seed_pages.locator("[data-testid=verdict]")).to_have_text("Right. The answer is 145.")
    why = page.locator("#quiz-seed-why")
    why.locator("textarea").fill("All eight need 128 + 8 x 17 = 264 pages, more than the 256 in the pool.")
    why.locator("button.reveal-answer").click()
    expect(why.locator("[data-testid=verdict]")).to_have_text("Right.")
    admitted = page.locator("#quiz-admitted")  # generated from the current controls (allowance 129)
    expect(admitted).to_contain_text("how many does the ledger admit")
    admitted.locator("input").fill("7")
    admitted.locator("button.reveal-answer").click()
    expect(admitted.locator("[data-testid=verdict]")).to_have_text("Not quite. The answer is 8.")
    _shot(page, "6-quiz")

    # Reload: everything above is still there, from localStorage alone.
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.locator("#p-one_group_admitted")).to_have_value("7")
    expect(page.locator("#c-max_new")).to_have_value("129")
    expect(page.locator("[data-testid=score-total]")).to_have_text("Your prediction: 5 of 5 right.")
    expect(one.locator("[data-testid=panel-summary]")).to_contain_text("8 of 8 admitted using 200 pages")
    expect(page.locator("#decision-text")).to_have_value(decision)
    expect(page.locator("[data-testid=decision-score]")).to_have_text("Your decision mentions 6 of 6 key points.")
    expect(seed_pages.locator("input[value='145']")).to_be_checked()
    expect(seed_pages.locator("[data-testid=verdict]")).to_have_text("Right. The answer is 145.")
    expect(admitted.locator("[data-testid=verdict]")).to_have_text("Not quite. The answer is 8.")
    _shot(page, "7-reloaded")

    # The further views ran on the server too.
    expect(page.locator("#forks-out")).to_contain_text("Step 1 of 12")
    page.locator("#forks-out button", has_text="Next step").click()
    expect(page.locator("#forks-out")).to_contain_text("block 2 is copied to block")
    expect(page.locator("#evict-out")).to_contain_text("Step 1 of 7")
    expect(page.locator("[data-testid=frag-contiguous]")).to_contain_text("hole failure")
    expect(page.locator("[data-testid=frag-paged]")).to_contain_text("admitted")

    # Labelled controls; nothing fetched from anywhere but the lab itself; no script errors.
    unlabelled = page.evaluate("""() => Array.from(document.querySelectorAll('input, select, textarea'))
        .filter(e => !e.closest('[hidden]') && e.type !== 'radio' && !(e.labels && e.labels.length)
                     && !e.getAttribute('aria-label')).map(e => e.id)""")
    assert unlabelled == []
    assert requested and all(u.startswith(lab_server.url) or u.startswith("data:") for u in requested), requested
    assert problems == []
    context.close()


def test_bad_controls_show_one_message_in_the_page(lab_server, browser):
    page = browser.new_page()
    page.set_default_timeout(20_000)
    page.goto(lab_server.url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    page.get_by_label("Pool bytes").fill("1KiB")
    page.locator("#reveal").click()
    error = page.locator("#predict-error")
    expect(error).to_be_visible()
    expect(error).to_have_text("pool of 1 KiB is smaller than one KV block (2 MiB)")
    page.get_by_label("Pool bytes").fill("512MiB")
    page.get_by_label("Requests", exact=True).fill("100000")
    page.locator("#reveal").click()
    expect(error).to_have_text("requests: must be <= 64 (got 100000)")
    _shot(page, "8-bad-input")
    page.close()


def test_a_bad_control_gets_the_controls_wording_whichever_answer_is_slower(lab_server, browser):
    """Reveal asks the server twice (the ledger run and the score). Both refuse bad controls, with
    different prefixes; when they were sent in parallel, whichever refusal arrived last wrote the message
    line, so the wording depended on timing. Here the score is made to answer late on purpose."""
    page = browser.new_page()
    page.set_default_timeout(20_000)
    slow: list[str] = []

    def late_score(route) -> None:
        slow.append(route.request.url)
        time.sleep(0.5)  # the ledger run's refusal is on the page by now
        route.continue_()

    page.route("**/api/score", late_score)
    page.goto(lab_server.url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    page.get_by_label("Requests", exact=True).fill("100000")
    page.locator("#reveal").click()
    error = page.locator("#predict-error")
    expect(error).to_have_text("requests: must be <= 64 (got 100000)")
    page.wait_for_timeout(1_000)  # long enough for a late answer to overwrite the line
    expect(error).to_have_text("requests: must be <= 64 (got 100000)")
    assert slow == []  # the score is not asked for controls the ledger refused
    page.close()
