#!/usr/bin/env bash
# Builds (or reuses) a Python 3.11 venv with torch (CPU), transformers and peft: the Hugging Face
# client the tests load exports in (tests/hf_client.py).
#
#   scripts/hf_venv.sh                 -> prints the venv's python on the last line of stdout
#   ORBAX_TUNIX_VENVS=/some/dir scripts/hf_venv.sh
#
# The venv lives at ${ORBAX_TUNIX_VENVS:-<repo>/.venvs}/hf and is reused while its stamp matches
# the hash of scripts/requirements-hf.txt and this script's recipe; otherwise it is rebuilt.
# orbax_tunix is not installed in it: the client reads files, never this package.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$REPO/scripts/requirements-hf.txt"
RECIPE_VERSION=1 # bump when the install steps below change
VENVS="${ORBAX_TUNIX_VENVS:-$REPO/.venvs}"
VENV="$VENVS/hf"
STAMP="$VENV/.orbax_tunix_stamp"
IMPORTS='import torch, transformers, peft, safetensors.torch'

log() { echo "[hf_venv] $*" >&2; }

# shellcheck source=python312.sh
source "$REPO/scripts/python312.sh"  # find_python

want_stamp="$( { echo "recipe=$RECIPE_VERSION"; cat "$REQS"; } | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
  log "reusing $VENV"
  echo "$VENV/bin/python"
  exit 0
fi

PY="$(find_python 3.11)" || { log "no Python 3.11 found (torch's CPU wheel here is for 3.11)"; exit 1; }
start=$SECONDS
log "building $VENV with $PY"
# The stamp is written last: an interrupted build has none and is rebuilt from scratch next time.
rm -rf "$VENV"
mkdir -p "$VENVS"
"$PY" -m venv "$VENV"
VPIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -q)
# torch first, alone: with its CPU build in place, the rest resolve against it and pull no CUDA.
# This machine kind's pip takes it from its configured wheels (a CPU build for Python 3.11);
# elsewhere ORBAX_TUNIX_TORCH_INDEX may name an index that holds one (PyPI's is a CUDA build).
"${VPIP[@]}" install --no-compile ${ORBAX_TUNIX_TORCH_INDEX:+--index-url "$ORBAX_TUNIX_TORCH_INDEX"} \
  "$(grep -E '^torch==' "$REQS")"
"${VPIP[@]}" install --no-compile -r "$REQS"
"$VENV/bin/python" -c "$IMPORTS" >/dev/null 2>&1 || { "$VENV/bin/python" -c "$IMPORTS" || true; log "import check failed"; exit 1; }
echo "$want_stamp" >"$STAMP"
log "built $VENV in $((SECONDS - start)) s"
echo "$VENV/bin/python"
