#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter (MaxText 0.2.5's stack needs it), or fails.
#
#   scripts/python312.sh                 -> /root/.pyenv/versions/3.12.1/bin/python3.12
#   source scripts/python312.sh          -> defines find_python312 and is_py312 only
#
# A pyenv shim named python3.12 exists even when 3.12 is not the selected version (and then
# fails), so every candidate is run, not just looked up; pyenv's versions are found also when
# pyenv itself is not on PATH (a non-login shell, CI).

is_py312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

find_python312() {
  local cand root v
  if cand="$(command -v python3.12 2>/dev/null)" && is_py312 "$cand"; then
    echo "$cand"; return 0
  fi
  if command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; else root="${PYENV_ROOT:-$HOME/.pyenv}"; fi
  if [ -d "$root/versions" ]; then
    for v in $(ls -1 "$root/versions" 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3,3nr); do
      cand="$root/versions/$v/bin/python3.12"
      if is_py312 "$cand"; then echo "$cand"; return 0; fi
    done
  fi
  for cand in /usr/bin/python3.12 /usr/local/bin/python3.12 /opt/python3.12/bin/python3.12; do
    if is_py312 "$cand"; then echo "$cand"; return 0; fi
  done
  return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  find_python312 || { echo "no Python 3.12 found (python3.12 on PATH, or pyenv's 3.12.x)" >&2; exit 1; }
fi
