#!/usr/bin/env bash
# Install real SGLang (CPU-usable, no GPU-only dependencies) into its own virtualenv.
#
# Why a separate venv: sglang pins transformers/tokenizers/openai/... exactly; keeping it
# apart from the project's environment means those pins can never break `stack` itself.
# The tests reach it through $SMETRIC_SGLANG_PYTHON (default: $SGLANG_VENV/bin/python).
#
#   bash .ci/install-sglang.sh            # full: ServerArgs + real CPU workers (tier `-m sglang`)
#   bash .ci/install-sglang.sh --args     # cheapest: enough for `from sglang.srt.server_args import ServerArgs`
#
# Idempotent: a stamp file records what was installed; a second run with the same
# requirements returns at once. Set SGLANG_VENV to choose where (default /opt/sglang-venv).
#
# What goes in (see docs/deploy/cpu-tier.md):
#   --args : CPU torch 2.13.0 (on this machine's disk) + triton + sglang --no-deps + the 13
#            pure-Python modules server_args imports. ~2.3 GB, ~40 s here.
#   full   : CUDA torch 2.14.1 + torchvision 0.29.1 (pip takes them from this machine's disk;
#            they import fine without a GPU; CPU torch 2.13 cannot pair with PyPI torchvision),
#            sglang --no-deps, its non-GPU requirements, mooncake-transfer-engine-non-cuda
#            (the CUDA Mooncake wheel does not import without libcuda), sglang-router 0.3.2 and
#            smg 1.13.0 (peer routers), OpenTelemetry's SDK and OTLP exporters (--enable-trace). ~6 GB.
set -euo pipefail

SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
SGLANG_VENV="${SGLANG_VENV:-/opt/sglang-venv}"
MODE=full
[[ "${1:-}" == "--args" ]] && MODE=args

# sglang 0.5.23's Requires-Dist minus everything GPU-only (flashinfer, sglang-kernel,
# flash-attn-4, deep-ep/gemm, flash-mla, cutlass-dsl, mathdx, nvshmem4py, quack-kernels,
# humming-kernels, tilelang, torch_memory_saver, apache-tvm-ffi, cuda-python) and what a
# text-only server never imports (torchaudio, torchcodec, datasets, modelscope, numba, py-spy,
# smg-grpc-servicer, deepseek-recipe, tml-renderers, kernels). The HTTP server imports soundfile
# (declared) and dill (undeclared), so both are in. sglang-router 0.3.2 and smg 1.13.0 (the
# current SGLang model gateway, sglang-router's successor on PyPI; brings grpcio and protobuf)
# are the peer routers the tier cross-checks our PD hand-off against. opentelemetry-sdk and the
# OTLP exporters: without them `--enable-trace` cannot start (sglang/srt/observability/trace.py
# imports them and, when missing, tracing is off); the tier checks that a worker's spans join
# the router's trace (tests/e2e/test_sglang_cpu.py, docs/operate/monitoring.md "Tracing").
ARGS_REQS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp)
FULL_REQS=(
  "${ARGS_REQS[@]}"
  anthropic "blobfile==3.0.0" "compressed-tensors==0.18.0" distro easydict einops fastapi gguf
  interegular "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" "openai==2.8.0" "openai-harmony==0.0.4"
  "outlines==0.1.11" partial_json_parser "prometheus-client>=0.20" "python-dateutil<3" python-multipart
  regex scipy "sentencepiece==0.2.1" setproctitle tiktoken "timm==1.0.25" "tokenizers==0.23.2"
  "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard
  msgpack httpx dill soundfile "mooncake-transfer-engine-non-cuda" "sglang-router==0.3.2" "smg==1.13.0"
  opentelemetry-sdk opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-grpc
)
if [[ $MODE == args ]]; then
  TORCH=("torch==2.13.0" triton)
  REQS=("${ARGS_REQS[@]}")
else
  TORCH=("torch==2.14.1" "torchvision==0.29.1")
  REQS=("${FULL_REQS[@]}")
fi

# requirements/sglang.lock.txt pins every package of the full venv (scripts/lock.sh --sglang makes it);
# each pip step below is constrained by it, and the stamp carries its hash, so a new lock reinstalls.
# SMETRIC_RELOCK=1 (scripts/lock.sh): build without the lock, to freeze a new one.
LOCK="$(cd "$(dirname "$0")/.." && pwd)/requirements/sglang.lock.txt"
LOCKED=()
if [[ "${SMETRIC_RELOCK:-0}" != "1" ]]; then LOCKED=(-c "$LOCK"); fi
STAMP="$SGLANG_VENV/.smetric-sglang-stamp"
WANT="$MODE sglang==$SGLANG_VERSION ${TORCH[*]} ${REQS[*]} lock=$(if [[ ${#LOCKED[@]} -gt 0 ]]; then sha256sum "$LOCK" | cut -c1-16; else echo none; fi)"
# a full install also satisfies --args
if [[ -f "$STAMP" ]] && { [[ "$(cat "$STAMP")" == "$WANT" ]] || { [[ $MODE == args ]] && grep -q '^full ' "$STAMP"; }; }; then
  echo "install-sglang: $SGLANG_VENV already has $(head -c 40 "$STAMP")... (nothing to do)"
  exit 0
fi

start=$(date +%s)
if [[ $MODE == full ]] && ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  # mooncake's TCP transport still links libibverbs
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null
fi
if [[ ! -x "$SGLANG_VENV/bin/python" ]]; then
  python3 -m venv "$SGLANG_VENV"
fi
PIP=("$SGLANG_VENV/bin/python" -m pip install -q --disable-pip-version-check --progress-bar off)
NOISE='^WARNING: Location|dependency conflicts|requires .*, which is not installed|but you have|^ERROR: pip.s dependency resolver'
pipq() {  # pip install, minus the noise of --no-deps installs; keeps pip's exit status
  local rc=0
  "${PIP[@]}" "$@" >"$SGLANG_VENV/.pip.log" 2>&1 || rc=$?
  grep -vE "$NOISE" "$SGLANG_VENV/.pip.log" || true
  return $rc
}
# torch first, alone, so nothing below can pull another build of it
pipq "${LOCKED[@]}" "${TORCH[@]}"
pipq "${LOCKED[@]}" --no-deps "sglang==$SGLANG_VERSION"
# constrain torch so a requirement that depends on torch keeps the one installed above
CONS=$(mktemp)
"$SGLANG_VENV/bin/python" - >"$CONS" <<'EOF'
import importlib.metadata as m
for d in ("torch", "torchvision", "triton"):
    try:
        print(f"{d}=={m.version(d)}")
    except m.PackageNotFoundError:
        pass
EOF
pipq -c "$CONS" "${LOCKED[@]}" "${REQS[@]}"
rm -f "$CONS"
if [[ $MODE == full && ${#LOCKED[@]} -gt 0 ]]; then  # the venv is the lock, nothing more or less
  extra=$("$SGLANG_VENV/bin/python" "$(dirname "$0")/../scripts/check_lock.py" "$LOCK" --list-extra)
  if [[ -n "$extra" ]]; then pipq_uninstall=("$SGLANG_VENV/bin/python" -m pip uninstall -q -y); "${pipq_uninstall[@]}" $extra; fi
  "$SGLANG_VENV/bin/python" "$(dirname "$0")/../scripts/check_lock.py" "$LOCK" --exact
fi
"$SGLANG_VENV/bin/python" -c "from sglang.srt.server_args import ServerArgs, prepare_server_args; import sglang; print('install-sglang: sglang', sglang.__version__, 'ServerArgs ok')"
if [[ $MODE == full ]]; then
  "$SGLANG_VENV/bin/python" -c "import mooncake.engine, torchvision, transformers; print('install-sglang: mooncake, torchvision', torchvision.__version__, 'transformers', transformers.__version__, 'ok')"
  "$SGLANG_VENV/bin/python" -c "import importlib.metadata as m, sglang_router, smg.smg_rs; print('install-sglang: sglang-router', m.version('sglang-router'), 'smg', m.version('smg'), 'ok')"
fi
echo "$WANT" >"$STAMP"
echo "install-sglang: $MODE install into $SGLANG_VENV took $(( $(date +%s) - start )) s"
