#!/usr/bin/env bash
# session 2026-12-08: issue 56 item 3 (speedup of the distilled pair, engine rows, B = 1, 16, 64),
# then the GEMM GPU tests' fixed forms
set -x
O=$PIPE_OUT; P=$PIPE_DIR
rm -rf $P/tree && cp -r .gpu/head $P/tree && cp .gpu/tree.txt $P/tree.txt
cd $P/tree
export PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $SECONDS $1" >> $O/progress.txt; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $O/env.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.txt 2>&1
python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.get_device_name())" >> $O/env.txt 2>&1
cat ../tree.txt >> $O/env.txt; nproc >> $O/env.txt
C=$(head -1 ../tree.txt)
stamp setup
timeout 560 python3 benchmarks/speedup.py --device cuda --batches 1,16,64 --modes greedy,sampled --verify block,token \
  --variants engine-speculative,engine-target-only --prompt-len 32 --new-tokens 64 --git-commit $C \
  --work $P/sp --out $O/speedup > $O/speedup_log.txt 2>&1
stamp speedup
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_batch_invariance.py -k linear \
  tests/kernels/test_linear.py tests/kernels/test_fp8_linear.py > $O/gemm_tests.txt 2>&1
stamp gemm_tests
touch $P/done
