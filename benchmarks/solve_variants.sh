#!/usr/bin/env bash
# The SFT sets of benchmarks/solve_variants.py, each trained and scored as the pipeline would, all at once on one GPU:
# pretrain + mid once (1 process, fp32, --grad-accum 2: the pipeline's global batch of 2 ranks), then for each set
# the SFT (1,500 steps, or 3,000), evaluate.py, GRPO (30 steps, 16 prompts a step: the pipeline's 2 x 8), evaluate.py.
# A table last; logs and metrics in $OUT/logs.tgz. BUDGET (seconds, default 440) stops the wait for the variants.
#     OUT=/tmp/out bash benchmarks/solve_variants.sh      (on the GPU machine: carry ../shared/gpu's wheels in .gpu/)
set -u
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R $OUT
if [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-index --no-deps .gpu/wheels/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
fi
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
python3 benchmarks/solve_variants.py $R > /dev/null || exit 1
T0=$(date +%s)
python3 pipeline.py --nproc 1 --seed 0 --out-dir $R --stages pretrain,mid --dtype fp32 --grad-accum 2 > $OUT/premid.log 2>&1 \
  || { tail -30 $OUT/premid.log; exit 1; }
echo "pretrain+mid $(( $(date +%s) - T0 )) s"
EV="--tasks arith_gen,arith_2op,arith_4op,solve,solve_long --limit 200"
chain() {  # name, data, extra SFT flags
  local d=$R/$1 t=$(date +%s)
  torchrun --standalone --nproc_per_node=1 fsdp2_sft.py --model small --seed 0 --out-dir $d/sft --replay builtin:0.1 \
    --save-every 500 --data $2 --init-from $R/mid --dtype fp32 --grad-accum 2 ${@:3} > $d.sft.log 2>&1 \
    || { echo "$1 sft failed"; tail -5 $d.sft.log; return; }
  echo "$1 sft $(( $(date +%s) - t )) s" >> $d.txt
  python3 evaluate.py $d/sft $EV 2>&1 | grep -E "accuracy|worked" | sed "s/^/$1 sft /" >> $d.txt
  torchrun --standalone --nproc_per_node=1 fsdp2_grpo.py --model small --seed 0 --out-dir $d/grpo --data builtin \
    --init-from $d/sft --reward exact-text --prompts-per-step 16 --dtype fp32 > $d.grpo.log 2>&1 \
    || { echo "$1 grpo failed"; tail -5 $d.grpo.log; return; }
  echo "$1 grpo $(( $(date +%s) - t )) s" >> $d.txt
  python3 evaluate.py $d/grpo $EV 2>&1 | grep -E "accuracy|worked" | sed "s/^/$1 grpo /" >> $d.txt
  grep -h '"worked"' $d/grpo/metrics.jsonl | python3 -c "import sys, json; print('$1 grpo worked/step',
    [round(json.loads(line)['worked'], 2) for line in sys.stdin][::3])" >> $d.txt
}
chain base builtin &
chain base3k builtin --max-steps 3000 &
chain mix13 $R/mix13.jsonl &
chain mix13_3k $R/mix13.jsonl --max-steps 3000 &
chain lead13 $R/lead13.jsonl &
chain mix13x6 $R/mix13x6.jsonl &
( sleep ${BUDGET:-440}; echo "budget reached at $(( $(date +%s) - T0 )) s" ) &
SLEEPER=$!
while [ $(jobs -rp | wc -l) -gt 1 ] && kill -0 $SLEEPER 2>/dev/null; do sleep 5; done
tar czf $OUT/logs.tgz $R/*.log $R/*/*/metrics.jsonl 2>/dev/null
for m in $R/*/*/metrics.jsonl; do echo "$m last step $(tail -1 $m | cut -c1-14)"; done
cat $R/*.txt | tee $OUT/table.txt
