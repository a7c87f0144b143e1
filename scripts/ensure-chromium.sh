#!/usr/bin/env bash
# Make sure Debian's headless-capable Chromium is at /usr/bin/chromium for the dashboard browser
# test (tests/gateway/dashboard/test_dashboard_browser.py, driven by Playwright's Python package).
# Never downloads Playwright's own browser builds. Exits 0 even when it cannot install: the test
# then skips with the reason.
set -u
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure-chromium: /usr/bin/chromium missing and no root to install it; the browser test will skip" >&2
        exit 0
    fi
fi
if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get install -y chromium >/dev/null 2>&1 \
        || { $SUDO apt-get update >/dev/null 2>&1 && $SUDO apt-get install -y chromium >/dev/null 2>&1; } \
        || echo "ensure-chromium: apt-get install chromium failed; the browser test will skip" >&2
else
    echo "ensure-chromium: no apt-get here; install Chromium at /usr/bin/chromium to run the browser test" >&2
fi
exit 0
