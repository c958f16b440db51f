#!/usr/bin/env bash
# Source on a GPU machine without network access, before benchmarks/gpu.sh, where torch, transformers and triton are
# installed already: installs this repository and the pure-Python packages it adds (hydra-core, omegaconf, the antlr4
# runtime, math-verify, latex2sympy2_extended) into $SITE from files carried in .whl/, offline. Fetch those first on a
# machine with network: pip download --no-deps -d .whl hydra-core omegaconf antlr4-python3-runtime==4.9.3 \
#   math-verify latex2sympy2_extended
#
#   source benchmarks/gpu_env.sh && OUT=/tmp/out bash benchmarks/gpu.sh kernel engine
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.tar.gz \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
  || { echo "gpu_env: install failed" >&2; return 1 2>/dev/null || exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast (NVLS) off: the product never needs it, and on shared hosts it can leave the GPUs unusable.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
