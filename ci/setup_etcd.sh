#!/usr/bin/env bash
# Install the etcd server the etcd discovery tests and benchmark start on loopback
# (Debian's etcd-server, 3.4.23 on bookworm). Idempotent: does nothing when `etcd` is
# already on PATH. Needs root (or sudo) and the Debian archive; the package's postinst
# may try to start etcd.service, which a container's policy-rc.d refuses: nothing is left
# running. The tests start their own etcd with a temporary data directory.
set -euo pipefail

if command -v etcd >/dev/null 2>&1; then
    echo "etcd already installed: $(etcd --version | head -n 1)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "ci/setup_etcd.sh: need root or sudo to apt-get install etcd-server" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
if ! apt-cache policy etcd-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
$SUDO apt-get install -y -qq etcd-server >/dev/null
echo "installed: $(etcd --version | head -n 1)"
