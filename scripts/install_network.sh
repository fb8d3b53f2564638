#!/usr/bin/env bash
# Installs what tests/netcluster (a cluster of network namespaces on this host, with real network faults between
# them) needs beyond a bare Debian/Ubuntu: `ip` and `tc` (iproute2), `nft` (nftables: random packet loss) and `ping`
# (iputils-ping). Needs root (or passwordless sudo); does nothing when all are already installed. Run by .ci/run; by
# hand: sudo bash scripts/install_network.sh
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
missing=()
have ip || missing+=(iproute2)
have tc || missing+=(iproute2)
have nft || missing+=(nftables)
have ping || missing+=(iputils-ping)
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
# shellcheck disable=SC2207  # package names have no spaces
apt_install install_network.sh --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u)
have ip && have tc && have nft && have ping
