#!/usr/bin/env bash
# Source on the lent GPU machine (tool `device`) before benchmarks/gpu.sh: installs the carried pure-python
# wheels in .whl/ (hydra-core, omegaconf, antlr4 runtime sdist, math-verify, latex2sympy2_extended; download them
# here with `pip download --no-deps` as /work/.library/device/README.md says) and this repo into /tmp/site, offline.
#
#   source benchmarks/gpu_env.sh && OUT=$OUT bash benchmarks/gpu.sh scale reshard_2gpu
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.tar.gz \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
  || { echo "gpu_env: install failed" >&2; return 1 2>/dev/null || exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on these machines (KINDS.md); the product never needs it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
