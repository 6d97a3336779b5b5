#!/usr/bin/env bash
# Set up everything RayMQ needs on a fresh machine: Java 17 for Spark, a Python 3.11
# virtual environment in .venv with the pinned dependencies, and the project itself.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[install] $*" >&2; }

need_java() {
    command -v java >/dev/null 2>&1 || return 0
    local v
    v=$(java -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')
    case "$v" in 17*|17) return 1 ;; *) return 0 ;; esac
}

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_install() {
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "$@"
}

if need_java; then
    log "Java 17 not found: installing openjdk-17-jre-headless with apt"
    apt_install openjdk-17-jre-headless
fi
log "$(java -version 2>&1 | head -1)"

# CI runs the `ray up ray_config.yaml` test (tests/client/test_deploy_ray_up.py): it needs sshd
# and rsync (elsewhere that test skips, saying so, when they are missing)
if [ "${CI:-}" = "true" ] && { [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null 2>&1; }; then
    log "CI: installing openssh-server and rsync with apt (for the ray up test)"
    apt_install openssh-server rsync
fi

# CI runs the console's browser test (tests/console/test_console_browser.py): headless Chromium
# and its driver from Debian's packages (elsewhere that test skips, naming what is missing)
if [ "${CI:-}" = "true" ] && { ! command -v chromium >/dev/null 2>&1 \
                               || ! command -v chromedriver >/dev/null 2>&1; }; then
    log "CI: installing chromium and chromium-driver with apt (for the console's browser test)"
    apt_install chromium chromium-driver
fi

# CI runs `raymq bench txmsg` at a small scale with its Redis baseline
# (tests/client/test_cli.py): redis-server from Debian's packages (elsewhere the bench
# skips that baseline, saying why)
if [ "${CI:-}" = "true" ] && ! command -v redis-server >/dev/null 2>&1; then
    log "CI: installing redis-server with apt (the txmsg bench's baseline)"
    apt_install redis-server
fi

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
    if command -v python3.11 >/dev/null 2>&1; then
        PYTHON=python3.11
    else
        log "RayMQ needs Python 3.11 (found $("$PYTHON" --version 2>&1))"
        exit 1
    fi
fi

if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
log "installing pinned dependencies (pyspark builds from source: about a minute)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
.venv/bin/python -m pip check >&2
touch .venv/.raymq-installed
log "done"
