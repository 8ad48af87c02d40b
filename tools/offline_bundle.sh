#!/usr/bin/env bash
# Pack what `make gpu-check` needs on a GPU machine that has torch preinstalled but no network
# (a cluster node, a container): the datasets, and the wheels of the test and Jupyter stack the
# suite and the notebooks run on, with every dependency they pull in. Run it here, on a machine
# with the data (`make data`) and PyPI; copy the folder it writes, `.offline/` (git-ignored,
# about 60 MB of wheels), along with the checkout. There, from the checkout:
#
#     bash tools/offline_bundle.sh --install   # PYTHON=python3 by default: the one with torch
#     make gpu-check PYTHON=<the python it names>
#
# PY_VERSION (default 3.12) is the GPU machine's Python; the wheels are for Linux x86-64.
# TORCH=2.11.0 (that machine's torch, `python3 -c "import torch; print(torch.__version__)"`)
# adds torchvision built for it, pytorch-lightning and torchmetrics, without torch itself;
# unset, the bundle leaves those three to the machine (gpu-check names them when missing).
# OMIT="numpy matplotlib" leaves out distributions that machine already has (smaller bundle).
# `--install` installs into PYTHON when that is a venv, else into a venv it makes,
# .offline/venv, that sees PYTHON's packages (torch, Lightning): pip resolves the bundle against
# them with no index, fails naming anything still missing, and the script then imports every
# module the bundle is for.
#
# How it was proven (docs/maintainers.md, "make gpu-check"): a clean Python 3.12 venv with only
# torch installed, then `PYTHON=<its python> bash tools/offline_bundle.sh --install` under
# `unshare -n` (no network), then one notebook executed with that Python.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.offline
# What gpu-check's required items (the suite, the notebooks) need besides torch, by pip's name:
# tools/gpu_check.py's COURSE_NEEDS, less WITH_TORCH: those depend on torch (torchvision on one
# release of it), so they are downloaded without their dependencies, and then their
# dependencies other than torch. pip adds the dependencies of PACKAGES.
# tests/harness/test_gpu_check.py holds these lists to gpu_check.py's.
PACKAGES=(pytest pytest-timeout pytest-xdist nbclient nbformat ipykernel ipython jupytext
          matplotlib tqdm)
WITH_TORCH=(torchvision pytorch-lightning torchmetrics)
# ... and the modules those give, imported after --install as its proof.
MODULES=pytest,pytest_timeout,xdist,nbclient,nbformat,ipykernel,IPython,jupytext,matplotlib,tqdm

if [ "${1:-}" = "--install" ]; then
  [ -d "$out/wheels" ] || { echo "error: no $out/wheels here; run this script without --install on a machine with PyPI first" >&2; exit 2; }
  py=${PYTHON:-python3}
  command -v "$py" >/dev/null || { echo "error: no $py here; set PYTHON to the Python that has torch" >&2; exit 2; }
  pip_wheel=
  for w in "$out"/wheels/pip-*.whl; do [ -f "$w" ] && pip_wheel=$w; done
  [ -n "$pip_wheel" ] || { echo "error: no pip wheel in $out/wheels; rebuild the bundle" >&2; exit 2; }
  if "$py" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    target=$("$py" -c 'import sys; print(sys.executable)')  # a venv: install into it
  else  # a system or cluster Python: a venv beside it, which sees its packages
    "$py" -m venv --without-pip --system-site-packages "$out/venv"
    target=$PWD/$out/venv/bin/python
  fi
  "$target" -c 'import torch' 2>/dev/null || { echo "error: $target cannot import torch; set PYTHON to the Python that has it" >&2; exit 2; }
  wanted=("${PACKAGES[@]}")
  for name in "${WITH_TORCH[@]}"; do  # those the bundle has (built with TORCH=...)
    for w in "$out"/wheels/"${name//-/_}"-*.whl; do [ -f "$w" ] && wanted+=("$name") && break; done
  done
  # pip run from its own wheel (the target needs no pip of its own), reading no configuration
  # and no PIP_* variable: the bundle is its only source, torch the target's own
  PIP_CONFIG_FILE=/dev/null "$target" "$pip_wheel/pip" --isolated install -q --no-index \
    --disable-pip-version-check --find-links "$out/wheels" "${wanted[@]}"
  "$target" -c "import $MODULES" || { echo "error: the bundle is installed but $target cannot import all of $MODULES" >&2; exit 1; }
  for raw in "$out"/data/*/raw; do
    [ -d "$raw" ] || continue
    mkdir -p "data/$(basename "$(dirname "$raw")")/raw"
    cp -n "$raw"/*.gz "data/$(basename "$(dirname "$raw")")/raw/"
  done
  DPT_OFFLINE=1 PYTHONPATH="$PWD" "$target" -m dpt.data fashion-mnist --optional mnist
  echo "installed: $target imports $MODULES; now: make gpu-check PYTHON=$target"
  exit 0
fi
mkdir -p "$out/wheels" "$out/data"
for folder in FashionMNIST MNIST; do  # dpt.data takes the .gz of each IDX file from raw/
  [ -d "data/$folder/raw" ] || { echo "note: no data/$folder (run \`make data\`)" >&2; continue; }
  mkdir -p "$out/data/$folder/raw"
  for f in "data/$folder/raw/"*-ubyte; do
    gz="$out/data/$folder/raw/$(basename "$f").gz"
    [ "$gz" -nt "$f" ] || gzip -9c "$f" > "$gz"
  done
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do platforms+=(--platform "$p"); done
# With their dependencies, resolved for the target Python and platform (none of them pulls
# torch); pip itself too, which --install runs from its wheel.
download=(python3 -m pip download -q --only-binary=:all: --implementation cp
          --python-version "${PY_VERSION:-3.12}" "${platforms[@]}" -d "$out/wheels")
"${download[@]}" pip "${PACKAGES[@]}"
if [ -n "${TORCH:-}" ]; then
  minor=$(echo "$TORCH" | cut -d. -f2)  # torchvision 0.(N+15) goes with torch 2.N
  "${download[@]}" --no-deps "torchvision==0.$((minor + 15)).*" "${WITH_TORCH[@]:1}"
  # their own requirements, torch left out; and torchvision's pin on torch checked
  deps=$(python3 - "$out/wheels" "$TORCH" <<'EOF'
import sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wheels, torch = Path(sys.argv[1]), sys.argv[2].split("+")[0]
for stem in ("torchvision", "pytorch_lightning", "torchmetrics"):
    wheel = max(wheels.glob(f"{stem}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    for line in meta.decode().splitlines():
        req = line.removeprefix("Requires-Dist:").strip()
        if not line.startswith("Requires-Dist:") or "extra ==" in req:
            continue
        name = Requirement(req).name.lower().replace("_", "-")
        if name not in ("torch", "torchvision", "pytorch-lightning", "torchmetrics"):
            print(req)
        elif name == "torch" and not Requirement(req).specifier.contains(torch, prereleases=True):
            sys.exit(f"error: {wheel.name} wants {req}, not torch {torch}")
EOF
)
  mapfile -t deps <<< "$deps"
  "${download[@]}" "${deps[@]}"
else
  echo "note: no TORCH=<the GPU machine's torch version>: torchvision, pytorch-lightning and torchmetrics are left to that machine" >&2
fi
for name in ${OMIT:-}; do  # wheel names spell a distribution with underscores
  norm=$(echo "$name" | tr 'A-Z.-' 'a-z__')
  find "$out/wheels" -maxdepth 1 -iname "${norm}-*.whl" -print -delete
done
du -sh "$out/wheels" "$out/data"
