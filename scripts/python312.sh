#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter (MaxText 0.2.5's stack needs it), or fails.
#
#   scripts/python312.sh                 -> /root/.pyenv/versions/3.12.1/bin/python3.12
#   source scripts/python312.sh          -> defines find_python X.Y (and find_python312,
#                                           is_python, is_py312) only
#
# A pyenv shim named python3.12 exists even when 3.12 is not the selected version (and then
# fails), so every candidate is run, not just looked up; pyenv's versions are found also when
# pyenv itself is not on PATH (a non-login shell, CI).

# is_python X.Y PATH: whether PATH runs Python X.Y.
is_python() {
  [ -n "$2" ] && "$2" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$1'.split('.'))))" >/dev/null 2>&1
}

# find_python X.Y: the path of a Python X.Y (python3.Y or python3 on PATH, pyenv's, /usr), or fail.
find_python() {
  local want="$1" cand root v
  for cand in "$(command -v "python$want" 2>/dev/null || true)" "$(command -v python3 2>/dev/null || true)"; do
    if is_python "$want" "$cand"; then echo "$cand"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; else root="${PYENV_ROOT:-$HOME/.pyenv}"; fi
  if [ -d "$root/versions" ]; then
    for v in $(ls -1 "$root/versions" 2>/dev/null | grep -E "^${want//./\\.}(\.[0-9]+)?\$" | sort -t. -k3,3nr); do
      cand="$root/versions/$v/bin/python$want"
      if is_python "$want" "$cand"; then echo "$cand"; return 0; fi
    done
  fi
  for cand in "/usr/bin/python$want" "/usr/local/bin/python$want" "/opt/python$want/bin/python$want"; do
    if is_python "$want" "$cand"; then echo "$cand"; return 0; fi
  done
  return 1
}

is_py312() { is_python 3.12 "$1"; }
find_python312() { find_python 3.12; }

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  find_python312 || { echo "no Python 3.12 found (python3.12 on PATH, or pyenv's 3.12.x)" >&2; exit 1; }
fi
