#!/usr/bin/env bash
# Packs MLX's CUDA build and the project for a GPU machine that takes at most 64 MiB of files per
# command, less than the mlx-cuda-13 wheel (~90 MB): the wheel goes in two parts, one a command.
#
#   bash bench/gpu/wheels.sh        # here, from anywhere in the checkout: makes .gpu/part1, .gpu/part2
#
# Then, on the GPU machine, two commands back to back (it is given back soon after a command ends):
#   1. carrying .gpu/part1:   bash .gpu/part1/stash.sh
#   2. carrying .gpu/part2:   source .gpu/part2/install.sh && python3 -m bench.run --device gpu ...
#
# install.sh installs mlx (CUDA), mlx-lm, the wheels the device image lacks and the project's own
# packages (built here as wheels, so their entry points and plugins exist there) into /tmp/site
# and puts it first on PYTHONPATH. Rebuild after changing the project's code.
#
# GPU_ARCHS="90" (H100, H200) keeps only those architectures' device code in the CUDA wheel
# (bench/gpu/prune.py: ~33 MB), which then goes whole in .gpu/part2: one command, no stash.
#
# Settings (environment): MLX_VERSION, MLX_LM_VERSION (default: the versions uv.lock pins);
# GPU_EXTRA_WHEELS: more pure-Python wheels the image lacks (default: llguidance for constrained
# decoding, prometheus-client for /metrics, gguf for GGUF imports, the openai SDK for the startup
# section's client with the wheels it needs beyond what the image has (its HTTP client, httpx2,
# and that one's own), and pytest-xdist with execnet, so the GPU tests compile their kernels on
# the machine's cores at once: `python3 -m pytest -n 12 tests/test_*_cuda.py`). The client's
# chain (openai, httpx2, httpcore2) is taken at uv.lock's versions, the versions the tests ran; the
# rest at the newest the device's Python takes (uv.lock's llguidance has no wheel for it).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
# uv builds the project's wheels at the end: check for it before the downloads (CI's fallback form).
if command -v uv >/dev/null 2>&1; then uv=(uv); elif python3 -m uv --version >/dev/null 2>&1; then
  uv=(python3 -m uv)
else
  echo "bench/gpu/wheels.sh needs uv to build the project's wheels: python3 -m pip install uv" >&2
  exit 1
fi
locked() { grep -A1 "^name = \"$1\"$" uv.lock | sed -n 's/^version = "\(.*\)"$/\1/p' | head -1; }
MLX=${MLX_VERSION:-$(locked mlx)}
MLXLM=${MLX_LM_VERSION:-$(locked mlx-lm)}
EXTRA=${GPU_EXTRA_WHEELS-llguidance prometheus-client gguf openai distro jiter sniffio httpx2 httpcore2 truststore pytest-xdist execnet}
rm -rf .gpu && mkdir -p .gpu/dl .gpu/part1 .gpu/part2
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
wheels() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
             --implementation cp "${plat[@]}" "$@" >/dev/null; }
wheels -d .gpu/dl "mlx==$MLX" "mlx-cuda-13==$MLX"
python3 -m pip download -q --no-deps -d .gpu/dl "mlx-lm==$MLXLM" >/dev/null
cuda=$(ls .gpu/dl/mlx_cuda_13-*.whl)
if [ -n "${GPU_ARCHS-}" ]; then  # pruned to those architectures: whole, in part2
  # shellcheck disable=SC2046
  python3 bench/gpu/prune.py "$cuda" $(for arch in $GPU_ARCHS; do echo --keep "$arch"; done)
  mv "$cuda" .gpu/part2/
  echo 'echo "nothing to stash: the CUDA wheel is whole in .gpu/part2"' > .gpu/part1/stash.sh
else
  split -b 46m "$cuda" .gpu/part1/cuda.part.  # two parts: .aa (part1), .ab (part2)
  mv .gpu/part1/cuda.part.ab .gpu/part2/
  cat > .gpu/part1/stash.sh <<'S'
mkdir -p /root/gpu-stash && cp .gpu/part1/cuda.part.aa /root/gpu-stash/ && echo "stashed part 1"
S
fi
mv .gpu/dl/mlx-*.whl .gpu/dl/mlx_lm-*.whl .gpu/part2/
# The image has numpy, safetensors, tokenizers, jinja2, pluggy, transformers and httpx, not these:
# shellcheck disable=SC2086
wheels -d .gpu/part2 pydantic pydantic-core annotated-types typing-inspection starlette uvicorn \
  $(for name in $EXTRA; do
      case $name in openai | httpx2 | httpcore2) echo "$name==$(locked "$name")" ;; *) echo "$name" ;; esac
    done)
basename "$cuda" > .gpu/part2/cuda-wheel-name
cat > .gpu/part2/install.sh <<'S'
name=$(cat .gpu/part2/cuda-wheel-name)
joined=()  # the two parts joined, where the wheel is not whole in part2 (GPU_ARCHS)
if [ ! -f ".gpu/part2/$name" ]; then
  cat /root/gpu-stash/cuda.part.aa .gpu/part2/cuda.part.ab > "/tmp/$name" \
    || { echo "part 1 missing: run .gpu/part1/stash.sh on this machine first"; return 1; }
  joined=("/tmp/$name")
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "${joined[@]}" .gpu/part2/*.whl .gpu/part2/project/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
S
# The project's own packages as wheels (core, plugins), so their entry points exist there too.
"${uv[@]}" build -q --all-packages --wheel -o .gpu/part2/project >/dev/null
rm -rf .gpu/dl
du -sh .gpu/part1 .gpu/part2
