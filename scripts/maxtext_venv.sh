#!/usr/bin/env bash
# Builds (or reuses) a Python 3.12 venv with MaxText 0.2.5 for CPU, plus orbax_tunix (editable),
# so tests can run MaxText's own trainer and checkpoint loaders against our checkpoints.
#
#   scripts/maxtext_venv.sh               -> prints the venv's python on the last line of stdout
#   scripts/maxtext_venv.sh --with-tunix  -> the same venv plus google-tunix 0.1.7 (an overlay, below)
#   ORBAX_TUNIX_VENVS=/some/dir scripts/maxtext_venv.sh
#
# The venv lives at ${ORBAX_TUNIX_VENVS:-<repo>/.venvs}/maxtext and is reused while its stamp
# matches the hash of scripts/requirements-maxtext.txt (+ the MaxText pin and this script's
# install recipe); otherwise it is rebuilt from scratch. Everything is installed with --no-deps
# from exact pins, so no resolver runs and nothing outside the list comes in.
#
# --with-tunix (for scripts/make_maxtext_fixtures.py only; the tests never use it): a second venv,
# ${ORBAX_TUNIX_VENVS:-<repo>/.venvs}/maxtext-tunix, made from the same Python, whose site-packages
# holds a .pth that adds the MaxText venv's site-packages (site.addsitedir, so its own .pth files,
# e.g. the editable orbax_tunix, apply too), plus scripts/requirements-maxtext-tunix.txt installed
# with --no-deps. Its own packages come first on sys.path. The MaxText venv is built or reused as
# without the flag and never written to; the overlay is rebuilt when the MaxText venv's stamp or
# the Tunix pins change. It prints the overlay's python.
#
# The machine-wide pip constraint file (/etc/xdg/pip/constraints.txt) caps only torch and
# torchvision, neither of which is installed here, so it is left in force.
set -euo pipefail

WITH_TUNIX=0
for arg in "$@"; do
  case "$arg" in
    --with-tunix) WITH_TUNIX=1 ;;
    *) echo "[maxtext_venv] unknown argument: $arg (expected --with-tunix)" >&2; exit 2 ;;
  esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$REPO/scripts/requirements-maxtext.txt"
MAXTEXT_PIN="maxtext==0.2.5"
RECIPE_VERSION=1 # bump when the install steps below change
VENVS="${ORBAX_TUNIX_VENVS:-$REPO/.venvs}"
VENV="$VENVS/maxtext"
STAMP="$VENV/.orbax_tunix_stamp"

log() { echo "[maxtext_venv] $*" >&2; }

# shellcheck source=python312.sh
source "$REPO/scripts/python312.sh"

want_stamp="$( { echo "recipe=$RECIPE_VERSION"; echo "$MAXTEXT_PIN"; cat "$REQS"; } | sha256sum | cut -d' ' -f1)"

build_maxtext() {
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] \
    && is_py312 "$VENV/bin/python"; then
    log "reusing $VENV"
    return 0
  fi
  local PY start
  PY="$(find_python312)" || { log "no Python 3.12 found (python3.12 on PATH, or pyenv's 3.12.x)"; return 1; }
  log "building $VENV with $PY"
  start=$SECONDS
  rm -rf "$VENV"
  mkdir -p "$VENVS"
  "$PY" -m venv "$VENV"
  local VPIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -q)
  # --no-compile: bytecode is written lazily on first import, which is cheaper than compiling
  # every file of transformers/jax/scipy up front.
  "${VPIP[@]}" install --no-deps --no-compile "$MAXTEXT_PIN"
  "${VPIP[@]}" install --no-deps --no-compile -r "$REQS"
  "${VPIP[@]}" install --no-deps -e "$REPO"
  # Fail now, not in the first test, if an import is missing.
  "$VENV/bin/python" -c 'import maxtext.trainers.pre_train.train, maxtext.common.checkpointing, maxtext.utils.model_creation_utils, orbax_tunix' >/dev/null 2>&1 \
    || { "$VENV/bin/python" -c 'import maxtext.trainers.pre_train.train, maxtext.common.checkpointing, maxtext.utils.model_creation_utils, orbax_tunix' || true; log "import check failed"; return 1; }
  echo "$want_stamp" >"$STAMP"
  log "built in $((SECONDS - start)) s"
}

build_tunix_overlay() {
  local TREQS="$REPO/scripts/requirements-maxtext-tunix.txt"
  local TVENV="$VENVS/maxtext-tunix"
  local TSTAMP="$TVENV/.orbax_tunix_stamp"
  local tstamp
  tstamp="$( { echo "overlay-recipe=1"; echo "$want_stamp"; cat "$TREQS"; } | sha256sum | cut -d' ' -f1)"
  if [ -x "$TVENV/bin/python" ] && [ -f "$TSTAMP" ] && [ "$(cat "$TSTAMP")" = "$tstamp" ]; then
    log "reusing $TVENV"
    echo "$TVENV/bin/python"
    return 0
  fi
  local start=$SECONDS base_py site
  log "building $TVENV (google-tunix on top of $VENV)"
  rm -rf "$TVENV"
  # The MaxText venv's own interpreter (its pyvenv.cfg names the base Python).
  base_py="$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')"
  "$base_py" -m venv "$TVENV"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local tsite
  tsite="$("$TVENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$site')" >"$tsite/_orbax_tunix_maxtext_base.pth"
  "$TVENV/bin/python" -m pip --disable-pip-version-check --no-input -q \
    install --no-deps --no-compile -r "$TREQS"
  "$TVENV/bin/python" -c 'import maxtext.utils.model_creation_utils, tunix.sft.peft_trainer, tunix.sft.checkpoint_manager' >/dev/null 2>&1 \
    || { "$TVENV/bin/python" -c 'import maxtext.utils.model_creation_utils, tunix.sft.peft_trainer, tunix.sft.checkpoint_manager' || true; log "tunix import check failed"; return 1; }
  echo "$tstamp" >"$TSTAMP"
  log "built $TVENV in $((SECONDS - start)) s"
  echo "$TVENV/bin/python"
}

build_maxtext
if [ "$WITH_TUNIX" = 1 ]; then
  build_tunix_overlay
else
  echo "$VENV/bin/python"
fi
