#!/usr/bin/env bash
# Install the system packages sprawl needs outside Python: bubblewrap (`bwrap`) for the sandbox.
#
# Idempotent: does nothing when bwrap is already on PATH. Installs with apt-get only when run as
# root on a Debian/Ubuntu host, running `apt-get update` first only if the package is not known
# to apt yet. Anywhere else it prints a warning and exits 0: the sandbox then refuses to start
# with an error naming sandbox.backend / sandbox.allow_unsandboxed (see docs/sandbox.md).
set -euo pipefail

warn() { echo "install-system-deps: WARNING: $*" >&2; }

if command -v bwrap >/dev/null 2>&1; then
    echo "install-system-deps: bubblewrap present ($(bwrap --version 2>/dev/null || echo unknown version))"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    warn "bubblewrap (bwrap) is missing and this is not root; install the 'bubblewrap' package (e.g. sudo apt-get install -y bubblewrap)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    warn "bubblewrap (bwrap) is missing and apt-get is not available; install bubblewrap with this system's package manager"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if ! apt-cache show bubblewrap >/dev/null 2>&1; then
    apt-get update -qq || warn "apt-get update failed"
fi
if apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; then
    echo "install-system-deps: installed $(bwrap --version)"
else
    warn "apt-get install bubblewrap failed; the sandbox will refuse to start until bwrap is installed"
fi
exit 0
