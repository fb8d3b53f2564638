# Sourced by the install_*.sh scripts: apt_install WHO [apt-get install options and packages] installs from the
# distribution's packages (Debian/Ubuntu) as root, or through passwordless sudo.
apt_install() {
  local who="$1"
  shift
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "$who: no apt-get here; install the packages $* with your package manager" >&2
    exit 1
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo -n"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
