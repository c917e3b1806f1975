# Sourced by the GPU scripts from the repository root with the bundle carried as .bundle: the
# bundle linked as build/, the folders its test binaries were built at pointed at this copy (so
# fixtures, plugins and lcx-train are found), and the library path set (scripts/gpu_env.sh).
#   source scripts/gpu_bundle.sh
lcx_root=$PWD
lcx_built_src=$(cat .bundle/source_dir 2>/dev/null)
lcx_built_build=$(cat .bundle/build_dir 2>/dev/null)
if [[ -n $lcx_built_src && $lcx_built_src != "$lcx_root" && ! -e $lcx_built_src ]]; then
  mkdir -p "$(dirname "$lcx_built_src")"
  ln -sfn "$lcx_root" "$lcx_built_src"
fi
ln -sfn "$lcx_root/.bundle" "$lcx_root/build"
[[ -n $lcx_built_build && ! -e $lcx_built_build ]] && ln -sfn "$lcx_root/.bundle" "$lcx_built_build"
source scripts/gpu_env.sh "$lcx_root/.bundle"
