# Source this on the GPU machine (no network, no pip install there): it lays the checkout out as the
# installed package (ops/ -> unimem_compile.ops, passes/ -> unimem_compile.passes) in a scratch folder
# and puts that on PYTHONPATH.   usage: source benchmarks/device_env.sh
_unimem_root=$(pwd)
_unimem_shim=${UNIMEM_SHIM:-/tmp/unimem_shim}
rm -rf "$_unimem_shim" && mkdir -p "$_unimem_shim"
cp -r "$_unimem_root/unimem_compile" "$_unimem_shim/"
cp -r "$_unimem_root/ops" "$_unimem_shim/unimem_compile/ops"
cp -r "$_unimem_root/passes" "$_unimem_shim/unimem_compile/passes"
export PYTHONPATH="$_unimem_shim${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
