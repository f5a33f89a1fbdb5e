#!/usr/bin/env bash
# System packages the multi-node tests use: sshd for the loopback nodes, pdsh for the pdsh runner,
# rsync for `crew sync` (which falls back to tar without it).
# Installs them when missing and this user may (root, or password-less sudo); otherwise says so,
# and the tests that need them are skipped with that reason.
set -u
missing=()
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
command -v pdsh >/dev/null || missing+=(pdsh)
command -v rsync >/dev/null || missing+=(rsync)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "system-deps: cannot install ${missing[*]} (not root, no password-less sudo); the ssh/pdsh/rsync tests will be skipped." >&2
  exit 0
fi
echo "system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
  || echo "system-deps: apt-get could not install ${missing[*]}; the ssh/pdsh/rsync tests will be skipped." >&2
exit 0
