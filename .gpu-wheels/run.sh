#!/bin/bash
# Device run (not committed): offline setup from the carried wheels, the GPU test set, the bench.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 --version; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader; nproc
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.__file__)"
TI=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/include/torch/csrc/distributed/c10d
grep -h "TORCH_FR_BUFFER_SIZE\|TORCH_FR_DUMP_TEMP_FILE" $TI/*.hpp $TI/*.h 2>/dev/null | head -4
strings $(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/lib/libtorch_cuda.so 2>/dev/null | grep -E '^TORCH_(FR|NCCL)_(BUFFER_SIZE|TRACE_BUFFER_SIZE|DUMP_TEMP_FILE|DEBUG_INFO_TEMP_FILE)$' | sort -u
which nvcc || echo "no nvcc"; echo "CUDA_HOME=${CUDA_HOME:-unset}"
python3 .gpu-wheels/filter.py
make setup WHEELHOUSE=.gpu-wheels TORCH=system BUILD_OPS=0 PYTHON=python3 || { echo "SETUP FAILED at $(el) s"; exit 3; }
echo "setup done at $(el) s"
.venv/bin/python -c "import launcher, deepspeed, hydra, torch; print('imports ok', torch.__version__, deepspeed.__version__)"
export PYTEST_ADDOPTS="--basetemp=/tmp/gpubt"
timeout 330 .venv/bin/python scripts/gpu_check.py --no-bench --keep /tmp/gpuwork --out $OUT/gpu-tests.md
echo "tests done at $(el) s (rc $?)"
mkdir -p $OUT/tests; cp -r /tmp/gpuwork/measured /tmp/gpuwork/junit.xml /tmp/gpuwork/gpu.json $OUT/tests/ 2>/dev/null
for d in /tmp/gpubt/gpu0/*; do n=$(basename $d); case $n in *.log) cp $d $OUT/tests/;; *) mkdir -p $OUT/tests/$n; cp $d/metrics.jsonl $d/summary.json $OUT/tests/$n/ 2>/dev/null;; esac; done
grep -l "deprecated" /tmp/gpubt/gpu0/*.log | head; grep -h "deprecated" /tmp/gpubt/gpu0/*.log | sort | uniq -c | head -5
LEFT=$(( 545 - $(el) ))
echo "bench budget $LEFT s"
if [ $LEFT -gt 60 ]; then
  timeout $(( LEFT + 40 )) .venv/bin/python scripts/gpu_check.py --no-tests --budget-s $(( LEFT - 20 )) --keep /tmp/benchwork --out $OUT/gpu-bench.md
  mkdir -p $OUT/bench; cp /tmp/benchwork/gpu.json $OUT/bench/ 2>/dev/null
fi
echo "all done at $(el) s"
