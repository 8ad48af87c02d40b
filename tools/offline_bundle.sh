#!/usr/bin/env bash
# Pack what `make gpu-check` needs on a GPU machine that has torch preinstalled but no network
# (a cluster node, a container): the datasets and wheels of the Jupyter stack the notebooks
# run on. Run it here, on a machine with the data (`make data`) and PyPI; copy the folder it
# writes, `.offline/` (git-ignored), along with the checkout. There, from the checkout:
#
#     bash tools/offline_bundle.sh --install   # wheels into .offline/site, data into data/
#     PYTHONPATH=$PWD/.offline/site make gpu-check PYTHON=python3
#
# PY_VERSION (default 3.12) is the GPU machine's Python. The wheels are those a Python with
# torch, Lightning and matplotlib usually lacks; `pip check` there names any still missing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.offline
if [ "${1:-}" = "--install" ]; then
  [ -d "$out/wheels" ] || { echo "error: no $out/wheels here; run this script without --install on a machine with PyPI first" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$out/site" "$out"/wheels/*.whl
  for raw in "$out"/data/*/raw; do
    [ -d "$raw" ] || continue
    mkdir -p "data/$(basename "$(dirname "$raw")")/raw"
    cp -n "$raw"/*.gz "data/$(basename "$(dirname "$raw")")/raw/"
  done
  DPT_OFFLINE=1 PYTHONPATH="$PWD:$PWD/$out/site" python3 -m dpt.data fashion-mnist --optional mnist
  echo "installed: now PYTHONPATH=$PWD/$out/site make gpu-check PYTHON=python3"
  exit 0
fi
mkdir -p "$out/wheels" "$out/data"
for folder in FashionMNIST MNIST; do  # dpt.data takes the .gz of each IDX file from raw/
  [ -d "data/$folder/raw" ] || { echo "note: no data/$folder (run \`make data\`)" >&2; continue; }
  mkdir -p "$out/data/$folder/raw"
  for f in "data/$folder/raw/"*-ubyte; do gzip -9c "$f" > "$out/data/$folder/raw/$(basename "$f").gz"; done
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
  --python-version "${PY_VERSION:-3.12}" "${platforms[@]}" -d "$out/wheels" \
  nbclient nbformat ipykernel jupytext jupyter_client jupyter_core traitlets pyzmq tornado \
  ipython comm debugpy matplotlib-inline nest-asyncio nest-asyncio2 fastjsonschema jsonschema \
  jsonschema-specifications referencing rpds-py platformdirs mdit-py-plugins decorator jedi \
  parso pexpect ptyprocess prompt-toolkit wcwidth stack-data asttokens executing pure-eval \
  ipython-pygments-lexers
du -sh "$out"
