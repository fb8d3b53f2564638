#!/usr/bin/env bash
# Installs a headless browser for tests/integration/test_dashboard.py: Chromium from the distribution's packages
# (Debian/Ubuntu), never a browser downloaded by a Python package. Needs root (or passwordless sudo); does nothing
# when one is already on PATH. Run by .ci/run; by hand: sudo bash scripts/install_browser.sh
set -euo pipefail
for browser in chromium chromium-browser google-chrome; do
  if command -v "$browser" >/dev/null 2>&1; then exit 0; fi
done
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser.sh: no apt-get here; install Chromium with your package manager" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
$SUDO apt-get update -qq
# Debian names the package chromium; Ubuntu's chromium-browser is a snap wrapper that does not run in containers.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null
