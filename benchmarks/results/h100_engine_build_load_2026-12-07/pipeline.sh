#!/usr/bin/env bash
# session 2026-12-07d: issue 52's targets on the GPU, dynamic batch (now the default) first
set -x
O=$PIPE_OUT; P=$PIPE_DIR
cd .gpu/head   # HEAD's tree (git archive): not the helpers' uncommitted edits
export PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $SECONDS $1" >> $O/progress.txt; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $O/env.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.txt 2>&1
python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.get_device_name())" >> $O/env.txt
cat ../tree.txt >> $O/env.txt; nproc >> $O/env.txt; free -g >> $O/env.txt
python3 -m dspark_compile.cli synth --preset tiny-trained --out $P/ck > $O/synth.txt 2>&1
stamp synth
# C. the default 7 buckets (CLI defaults: max-seq-len 1024, prefill auto, target programs). Targets: build <= 120 s, cold load <= 5 s
export TRITON_CACHE_DIR=$P/tc_c
/usr/bin/time -v timeout 400 python3 -m dspark_compile.cli build $P/ck --out $P/eng_c > $O/c_build.txt 2> $O/c_build_time.txt
unset TRITON_CACHE_DIR
stamp c_build
timeout 90 python3 benchmarks/load_time.py --engine $P/eng_c --cases cold-store --out $O/c_load > $O/c_load_log.txt 2>&1
stamp c_load
timeout 90 python3 -m dspark_compile.cli run $P/eng_c --prompt-ids 1,2,3,4,5 --prompt-ids 7,8 --max-new-tokens 24 --check-lossless > $O/c_lossless.txt 2>&1
stamp c_lossless
touch $P/done
