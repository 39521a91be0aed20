#!/usr/bin/env bash
# Wheels the benchmarks need on an accelerator host whose own package index lacks them
# (orbax-checkpoint 0.12.8 and what it needs), to carry there beside the repository.
#
#   bash benchmarks/accelerator_wheels.sh PYTHON_VERSION [DIR]    # e.g. 3.11 .whl-accel
#
# PYTHON_VERSION is the accelerator host's (`python3 -V` there); DIR is where the wheels go
# (default: .whl-accel at the repository's root, which .gitignore leaves out of git).
#
# It resolves this package's requirements (pyproject.toml: its dependencies and the extras
# `bench` and `cli`) at the versions of constraints.txt for that Python on manylinux x86-64,
# then downloads each wheel alone (`--no-deps`), leaving out JAX's own stack (jax, jaxlib,
# libtpu, the CUDA plugins, numpy, scipy, ml_dtypes, opt_einsum): the accelerator host has its
# own, built for its device. On the accelerator host, from the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site     # the host's own JAX stays first
#
# The wheels' total size is printed at the end: the repository and DIR travel together.
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
pyver="$1"
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${2:-$root/.whl-accel}"
python="${PYTHON:-python3}"
# manylinux tags, newest first: pip matches each one exactly.
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
target=(--only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}")
# What the accelerator host brings (its JAX and what JAX needs): never carried.
host_has='^(jax|jaxlib|libtpu|libtpu-nightly|jax-cuda12-plugin|jax-cuda12-pjrt|numpy|scipy|ml-dtypes|opt-einsum)$'

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/requirements.py" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], 'rb'))['project']
extras = project['optional-dependencies']
print('\n'.join(project['dependencies'] + extras['bench'] + extras['cli']))
PY
cat >"$tmp/wanted.py" <<'PY'
import json, re, sys
skip = re.compile(sys.argv[2])
for item in json.load(open(sys.argv[1]))['install']:
  name = re.sub(r'[-_.]+', '-', item['metadata']['name']).lower()
  if not skip.match(name):
    print(f"{name}=={item['metadata']['version']}")
PY
"$python" "$tmp/requirements.py" "$root/pyproject.toml" >"$tmp/requirements.txt"
# Resolve for the target Python and platform; nothing is installed here.
"$python" -m pip install -q --dry-run --ignore-installed --report "$tmp/report.json" \
  --target "$tmp/none" "${target[@]}" -c "$root/constraints.txt" -r "$tmp/requirements.txt" >&2
"$python" "$tmp/wanted.py" "$tmp/report.json" "$host_has" >"$tmp/wanted.txt"
mkdir -p "$dir"
echo "downloading for Python $pyver into $dir: $(tr '\n' ' ' <"$tmp/wanted.txt")" >&2
"$python" -m pip download -q --no-deps "${target[@]}" -d "$dir" -r "$tmp/wanted.txt" >&2
ls "$dir"
echo "total: $(du -sh "$dir" | cut -f1) in $(ls "$dir" | wc -l) wheels" >&2
