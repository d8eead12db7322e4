#!/usr/bin/env bash
# session 2026-12-07f part 1: issue 55 (GEMM tile sweep; flash-slice honest floor + per layer +
# prediction at HEAD and the base tree's step at 16,64; tiny vs torch.compile; tiny-deep check),
# issue 56 (speedup of the committed pair)
set -x
O=$PIPE_OUT; P=$PIPE_DIR
rm -rf $P/tree $P/base && cp -r .gpu/head $P/tree && cp -r .gpu/base $P/base && cp .gpu/tree.txt $P/tree.txt
cd $P/tree        # a copy: a later call's carry replaces .gpu, not this
export PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $SECONDS $1" >> $O/progress.txt; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $O/env.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.txt 2>&1
python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.get_device_name())" >> $O/env.txt 2>&1
cat ../tree.txt >> $O/env.txt; nproc >> $O/env.txt
C=$(head -1 ../tree.txt); B=$(sed -n 2p ../tree.txt)
stamp setup
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_batch_invariance.py -k linear \
  tests/kernels/test_linear.py tests/kernels/test_fp8_linear.py tests/kernels/test_fp8_linear_multi.py > $O/gemm_tests.txt 2>&1
stamp gemm_tests
timeout 660 python3 benchmarks/step.py --preset flash-slice --buckets 1,4,16,64 --variants engine,engine-greedy \
  --cases mixed,greedy --replays 20 --per-layer all --git-commit $C --work $P/sw --out $O/step_flash > $O/step_flash_log.txt 2>&1
rm -rf $P/sw
stamp step_flash
timeout 300 python3 benchmarks/speedup.py --device cuda --batches 1,16,64 --modes greedy,sampled --verify block,token \
  --prompt-len 32 --new-tokens 64 --out $O/speedup > $O/speedup_log.txt 2>&1
stamp speedup
(cd $P/base && python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install_base.txt 2>&1 && timeout 420 python3 benchmarks/step.py --preset flash-slice --buckets 1,16,64 --variants engine \
  --cases mixed --replays 20 --per-layer none --git-commit $B --work $P/bw --out $O/step_flash_base > $O/step_flash_base_log.txt 2>&1)
rm -rf $P/bw
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install2.txt 2>&1
stamp step_flash_base
timeout 300 python3 benchmarks/kernel_bench.py --only gemm_tiles --batches 16,64 --calls-per-graph 8 --replays 20 \
  --variant-budget 5 --git-commit $B --out $O/gemm_tiles > $O/gemm_tiles_log.txt 2>&1
stamp gemm_tiles
timeout 400 python3 benchmarks/step.py --preset tiny --buckets 1,16 --variants engine,engine-greedy,compile-graph \
  --cases mixed,greedy --replays 20 --per-layer all --compile-budget-s 90 --git-commit $C --work $P/tw --out $O/step_tiny > $O/step_tiny_log.txt 2>&1
stamp step_tiny
timeout 400 python3 benchmarks/step.py --preset tiny-deep --buckets 1,16 --variants engine \
  --cases mixed --replays 20 --per-layer none --git-commit $C --work $P/dw --out $O/step_deep > $O/step_deep_log.txt 2>&1
stamp step_deep
touch $P/done
