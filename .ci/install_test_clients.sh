#!/usr/bin/env bash
# The Kafka clients the tests run that are not Python packages: kafkajs (Node.js), as
# pinned by tests/wire/kafkajs/package-lock.json.  `make test` runs this; a node that
# `ray up` installs does not need it.  In CI, Node.js and npm come from Debian's packages
# where the machine has none, and a failure stops the run; elsewhere a machine without
# npm (or without its registry) skips the kafkajs test, which says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[install] $*" >&2; }

if ! command -v npm >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
        log "CI: installing nodejs and npm with apt (for the kafkajs test)"
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -q
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q nodejs npm
    else
        log "npm not found: the kafkajs test will skip (apt-get install nodejs npm)"
        exit 0
    fi
fi
log "installing kafkajs for the Kafka listener's tests (npm ci in tests/wire/kafkajs)"
if ! npm ci --prefix tests/wire/kafkajs --no-audit --no-fund --loglevel=error >&2; then
    if [ "${CI:-}" = "true" ]; then
        exit 1
    fi
    log "npm ci failed: the kafkajs test will skip"
fi
