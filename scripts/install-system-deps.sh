#!/usr/bin/env bash
# Install the system packages sprawl needs outside Python: for the sandbox, bubblewrap (`bwrap`)
# and libseccomp (`libseccomp.so.2`, which compiles the sandbox's syscall filter); for the test
# of what a run shows in a real terminal, tmux.
#
# Idempotent: does nothing when all are present. Installs with apt-get only when run as root on
# a Debian/Ubuntu host, running `apt-get update` first only if a package is not known to apt
# yet. Anywhere else it prints a warning and exits 0: the sandbox then refuses to start with an
# error naming sandbox.backend / sandbox.allow_unsandboxed (see docs/sandbox.md).
set -euo pipefail

warn() { echo "install-system-deps: WARNING: $*" >&2; }

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
{ ldconfig -p 2>/dev/null || true; } | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-system-deps: bubblewrap present ($(bwrap --version 2>/dev/null || echo unknown version)), libseccomp present, tmux present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    warn "${missing[*]} missing and this is not root; install them (e.g. sudo apt-get install -y ${missing[*]})"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    warn "${missing[*]} missing and apt-get is not available; install them with this system's package manager"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
for package in "${missing[@]}"; do
    if ! apt-cache show "$package" >/dev/null 2>&1; then
        apt-get update -qq || warn "apt-get update failed"
        break
    fi
done
if apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    echo "install-system-deps: installed ${missing[*]}"
else
    warn "apt-get install ${missing[*]} failed; the sandbox refuses to start without bubblewrap and libseccomp, and the terminal test is skipped without tmux"
fi
exit 0
