#!/usr/bin/env bash
# Builds (or reuses) a Python 3.12 venv with MaxText 0.2.5 for CPU, plus orbax_tunix (editable),
# so tests can run MaxText's own trainer and checkpoint loaders against our checkpoints.
#
#   scripts/maxtext_venv.sh            -> prints the venv's python on the last line of stdout
#   ORBAX_TUNIX_VENVS=/some/dir scripts/maxtext_venv.sh
#
# The venv lives at ${ORBAX_TUNIX_VENVS:-<repo>/.venvs}/maxtext and is reused while its stamp
# matches the hash of scripts/requirements-maxtext.txt (+ the MaxText pin and this script's
# install recipe); otherwise it is rebuilt from scratch. Everything is installed with --no-deps
# from exact pins, so no resolver runs and nothing outside the list comes in.
#
# The machine-wide pip constraint file (/etc/xdg/pip/constraints.txt) caps only torch and
# torchvision, neither of which is installed here, so it is left in force.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$REPO/scripts/requirements-maxtext.txt"
MAXTEXT_PIN="maxtext==0.2.5"
RECIPE_VERSION=1 # bump when the install steps below change
VENVS="${ORBAX_TUNIX_VENVS:-$REPO/.venvs}"
VENV="$VENVS/maxtext"
STAMP="$VENV/.orbax_tunix_stamp"

log() { echo "[maxtext_venv] $*" >&2; }

is_py312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

find_python312() {
  local cand
  # A pyenv shim named python3.12 exists even when 3.12 is not the selected version (and then
  # fails), so every candidate is run, not just looked up.
  if cand="$(command -v python3.12 2>/dev/null)" && is_py312 "$cand"; then
    echo "$cand"; return 0
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local root v
    root="$(pyenv root)"
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

want_stamp="$( { echo "recipe=$RECIPE_VERSION"; echo "$MAXTEXT_PIN"; cat "$REQS"; } | sha256sum | cut -d' ' -f1)"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] \
  && is_py312 "$VENV/bin/python"; then
  log "reusing $VENV"
  echo "$VENV/bin/python"
  exit 0
fi

PY="$(find_python312)" || { log "no Python 3.12 found (python3.12 on PATH, or pyenv's 3.12.x)"; exit 1; }
log "building $VENV with $PY"
start=$SECONDS
rm -rf "$VENV"
mkdir -p "$VENVS"
"$PY" -m venv "$VENV"
VPIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -q)
# --no-compile: bytecode is written lazily on first import, which is cheaper than compiling
# every file of transformers/jax/scipy up front.
"${VPIP[@]}" install --no-deps --no-compile "$MAXTEXT_PIN"
"${VPIP[@]}" install --no-deps --no-compile -r "$REQS"
"${VPIP[@]}" install --no-deps -e "$REPO"
# Fail now, not in the first test, if an import is missing.
"$VENV/bin/python" -c 'import maxtext.trainers.pre_train.train, maxtext.common.checkpointing, maxtext.utils.model_creation_utils, orbax_tunix' >/dev/null 2>&1 \
  || { "$VENV/bin/python" -c 'import maxtext.trainers.pre_train.train, maxtext.common.checkpointing, maxtext.utils.model_creation_utils, orbax_tunix' || true; log "import check failed"; exit 1; }
echo "$want_stamp" >"$STAMP"
log "built in $((SECONDS - start)) s"
echo "$VENV/bin/python"
