#!/usr/bin/env bash
# Installs SLURM and munge from the distribution's packages (Debian/Ubuntu) for the tests of `fthsdp slurm`
# (tests/slurm/), which start a cluster of several nodes on this one host. Needs root (or passwordless sudo); does
# nothing when slurmctld, slurmd, sbatch and munged are already installed. Run by .ci/run; by hand:
# sudo bash scripts/install_slurm.sh
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have slurmctld && have slurmd && have sbatch && have munged; then exit 0; fi
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install install_slurm.sh --no-install-recommends slurmctld slurmd slurm-client munge
have slurmctld && have slurmd && have sbatch && have munged
