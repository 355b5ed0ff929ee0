set -u
source benchmarks/device_env.sh
export TRITON_INTERPRET=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ic
L=$OUT/log2.txt
timeout 150 python3 -P -m pytest -v -p no:cacheprovider -rs -x -p pytest_timeout --timeout=35 tests/gpu -k "not test_passes_gpu" > $L 2>&1; echo "tests rc=$?" >> $L
timeout 140 python3 -P -X faulthandler -c "
import faulthandler, sys; faulthandler.dump_traceback_later(115, exit=True)
from unimem_compile.cli import main; sys.exit(main(['demo','--model','kimi-linear-48b-4l','--device','cuda','--cudagraphs','--json','--new-tokens','16']))
" > $OUT/demo.txt 2>&1; echo "demo rc=$?" >> $L
tail -c 3000 $OUT/demo.txt; grep -E "PASS|FAIL|Timeout|rc=|Error" $L | tail -40
