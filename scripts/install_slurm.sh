#!/usr/bin/env bash
# Installs SLURM and munge from the distribution's packages (Debian/Ubuntu) for the tests of `fthsdp slurm`
# (tests/slurm/), which start a cluster of several nodes on this one host. Needs root (or passwordless sudo); does
# nothing when slurmctld, slurmd, sbatch and munged are already installed. Run by .ci/run; by hand:
# sudo bash scripts/install_slurm.sh
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have slurmctld && have slurmd && have sbatch && have munged; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm.sh: no apt-get here; install slurmctld, slurmd, slurm-client and munge with your package manager" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  slurmctld slurmd slurm-client munge >/dev/null
have slurmctld && have slurmd && have sbatch && have munged
