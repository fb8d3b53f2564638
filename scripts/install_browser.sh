#!/usr/bin/env bash
# Installs a headless browser for tests/integration/test_dashboard.py: Chromium from the distribution's packages
# (Debian/Ubuntu), never a browser downloaded by a Python package. Needs root (or passwordless sudo); does nothing
# when one is already on PATH. Run by .ci/run; by hand: sudo bash scripts/install_browser.sh
set -euo pipefail
for browser in chromium chromium-browser google-chrome; do
  if command -v "$browser" >/dev/null 2>&1; then exit 0; fi
done
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
# Debian names the package chromium; Ubuntu's chromium-browser is a snap wrapper that does not run in containers.
apt_install install_browser.sh chromium
command -v chromium >/dev/null
