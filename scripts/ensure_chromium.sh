#!/usr/bin/env bash
# The browser tests drive Debian's `chromium` package through Playwright's `executable_path` (never
# `playwright install`, which downloads a browser of its own). Install it when it is missing and we can.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: installing Debian's chromium package for the browser tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
    exit 0
fi
echo "ensure_chromium: chromium is missing and cannot be installed here (needs root and apt-get);" \
     "the browser tests will fail until 'apt-get install chromium' is run" >&2
