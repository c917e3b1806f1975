# Sourced by the GPU scripts: the library path a bundle needs on the GPU machine. The bundle's own
# lib/ first, then the CUDA toolkit's, then the wheels beside the image's PyTorch (cuDNN, NCCL).
#   source scripts/gpu_env.sh BUNDLE
lcx_libs=$1/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [[ -d $d ]] && lcx_libs+=":$d"; done
lcx_wheel_libs=$(python3 - 2>/dev/null <<'PY'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))})))
PY
)
[[ -n $lcx_wheel_libs ]] && lcx_libs+=":$lcx_wheel_libs"
export LD_LIBRARY_PATH=$lcx_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NVLink multicast stays off on shared GPU hosts.
export NCCL_NVLS_ENABLE=0
