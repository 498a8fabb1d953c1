#!/bin/sh
# Set up what tests/test_browser.py needs (for .ci/run): Debian's Chromium and playwright-python.
# playwright drives /usr/bin/chromium through executable_path; `playwright install` is never run (it would
# download browsers, which CI cannot). Without /usr/bin/chromium the browser tests skip with a reason.
#
#   sh tests/browser.sh            # as root (or with sudo), inside the project's virtual environment
#   python -m pytest tests/test_html.py tests/test_browser.py -q      # screenshots land in tests/artifacts/
#   python -m pytest -m browser -q                                      # the browser tests alone
#
# The tests launch Chromium with:
#   --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
#   --disable-component-update --disable-sync
set -eu
if [ ! -x /usr/bin/chromium ]; then
    apt-get update
    apt-get install -y --no-install-recommends chromium
fi
python -m pip install "playwright>=1.40"
/usr/bin/chromium --version
