#!/usr/bin/env bash
# Tests start their own redis-server on a free port; this makes sure the binary exists.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then exit 0; fi
echo "redis-server or redis-cli not found: installing Debian's redis-server package" >&2
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
