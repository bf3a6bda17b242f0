#!/usr/bin/env bash
# The browser tests (tests/lab/test_browser.py) drive Debian's `chromium` package through Playwright's
# `executable_path` (never `playwright install`, which downloads a browser of its own). `make test` and
# `.ci/run` call this first: it says what it does, and installs chromium only when it is missing, we are
# root and apt-get exists. It never fails: without chromium the browser tests skip with one line
# (KVLEDGER_BROWSER=required, as .ci/run sets, makes them fail instead). KVLEDGER_BROWSER=off skips both
# the install and the browser tests.
set -uo pipefail
say() { echo "ensure_chromium: $*" >&2; }

if [ "${KVLEDGER_BROWSER:-auto}" = "off" ]; then
    say "KVLEDGER_BROWSER=off: no browser install; the browser tests will be skipped"
    exit 0
fi
for name in chromium chromium-browser; do
    if path=$(command -v "$name" 2>/dev/null); then
        say "chromium found ($path): the browser tests will use it; nothing to install"
        exit 0
    fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    why=$([ "$(id -u)" != 0 ] && echo "not root" || echo "no apt-get")
    say "chromium is missing and cannot be installed here ($why): the browser tests will be skipped;" \
        "'sudo apt-get install chromium' enables them"
    exit 0
fi
say "chromium is missing; the browser tests need it. Installing Debian's chromium package as root:" \
    "'apt-get update' then 'apt-get install chromium' (a few hundred MB; KVLEDGER_BROWSER=off skips this)"
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq chromium >/dev/null; then
    say "installed $(command -v chromium || command -v chromium-browser)"
else
    say "'apt-get install chromium' failed (see above): the browser tests will be skipped"
fi
exit 0
