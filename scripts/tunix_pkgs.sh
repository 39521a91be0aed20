#!/usr/bin/env bash
# Installs google-tunix 0.1.7 and the few packages its imports need beyond the test venv into a
# plain directory (not a venv), for tests/tunix_client.py:
#
#   PYTHON=/path/to/test-venv/python scripts/tunix_pkgs.sh   -> prints the directory on the last
#                                                                line of stdout
#   ORBAX_TUNIX_VENVS=/some/dir scripts/tunix_pkgs.sh
#
# The directory is ${ORBAX_TUNIX_VENVS:-<repo>/.venvs}/tunix-pkgs, filled with
#   ${PYTHON:-python3} -m pip install --no-deps --target DIR -r scripts/requirements-tunix.txt
# i.e. with the pip of the interpreter that will run the worker (the tests pass sys.executable),
# so wheels match its Python. The worker runs as `$PYTHON tests/tunix_client.py` with
# PYTHONPATH=DIR: jax, flax, optax, orbax-checkpoint, qwix and numpy are the test venv's pinned
# ones, tunix and its few extras come from DIR. Nothing is installed into the venv itself.
#
# Reused while DIR's stamp matches the hash of the requirements, this script's recipe and the
# interpreter's version; otherwise rebuilt beside DIR and swapped in at the end (a failed or
# interrupted build leaves the previous DIR, or none, never a half-filled one). Ends with an
# import check of the modules the worker uses, run the way the worker runs.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$REPO/scripts/requirements-tunix.txt"
RECIPE_VERSION=1 # bump when the install steps below change
PY="${PYTHON:-python3}"
VENVS="${ORBAX_TUNIX_VENVS:-$REPO/.venvs}"
DIR="$VENVS/tunix-pkgs"
STAMP="$DIR/.orbax_tunix_stamp"
IMPORTS='import tunix.models.qwen3.params, tunix.models.llama3.params, tunix.models.gemma3.params_safetensors, tunix.models.safetensors_saver, tunix.sft.checkpoint_manager, safetensors.numpy, qwix'

log() { echo "[tunix_pkgs] $*" >&2; }

pyver="$("$PY" -c 'import sys; print(sys.version.split()[0], sys.implementation.cache_tag)')"
want_stamp="$( { echo "recipe=$RECIPE_VERSION"; echo "python=$pyver"; cat "$REQS"; } | sha256sum | cut -d' ' -f1)"

check_imports() {
  env PYTHONPATH="$1" JAX_PLATFORMS=cpu "$PY" -c "$IMPORTS"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
  log "reusing $DIR"
  echo "$DIR"
  exit 0
fi

start=$SECONDS
mkdir -p "$VENVS"
NEW="$(mktemp -d "$VENVS/.tunix-pkgs.new.XXXXXX")"
trap 'rm -rf "$NEW"' EXIT
log "installing into $DIR with $PY ($pyver)"
"$PY" -m pip --disable-pip-version-check --no-input -q \
  install --no-deps --target "$NEW" -r "$REQS"
if ! check_imports "$NEW" >/dev/null 2>&1; then
  check_imports "$NEW" || true
  log "import check failed"
  exit 1
fi
echo "$want_stamp" >"$NEW/.orbax_tunix_stamp"
OLD=""
if [ -e "$DIR" ]; then
  OLD="$VENVS/.tunix-pkgs.old.$$"
  mv "$DIR" "$OLD"
fi
mv "$NEW" "$DIR"
trap - EXIT
[ -n "$OLD" ] && rm -rf "$OLD"
log "built $DIR in $((SECONDS - start)) s"
echo "$DIR"
