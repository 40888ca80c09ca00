#!/usr/bin/env bash
# What to measure on a bigger machine lent for a few minutes (the 16-core Xeon host of
# a lent GPU machine, say), in one command of about 9 minutes, results in $OUT (default
# bench/results/lent): the CPU, an in-place build, a quick calibration on every core
# and the performance model's breakdown of GPT-2 (4, 256) from it, our step's profile
# at all cores and at one, and the step against PyTorch at 16, 8, 4, 2 and 1 threads.
#
#   OUT=/some/dir bash bench/lent_machine.sh
#
# Each part has its own time limit, so a slow part costs only itself; the thread scan
# writes its records after every thread count, largest first.  As the scripts it runs,
# it also leaves bench/results/step_profile.json and thread_scan.json/.png (copied to
# $OUT).  Session 38 ran its first form on the lent Xeon EMR (7 minutes, 16 cores).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/lent}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
N=$(nproc)

lscpu > "$OUT/lscpu.txt"
grep -m1 "model name" /proc/cpuinfo
grep -o -w -E "avx512f|avx512_bf16|amx_bf16|amx_tile" /proc/cpuinfo | sort | uniq -c
python3 -c "import numpy, scipy, torch; print('numpy', numpy.__version__, 'scipy', scipy.__version__, 'torch', torch.__version__)"

python3 setup.py build_ext --inplace -j "$N" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
say "built"

timeout 150 python3 -m gpt2.perfmodel.calibrate --threads "$N" --quick --output "$OUT/profile_${N}t.json" \
    > "$OUT/calibrate.log" 2>&1
tail -1 "$OUT/calibrate.log"
for p in fp32 bf16; do
    timeout 30 python3 -m gpt2.perfmodel --model gpt2 --batch 4 --seq 256 --precision "$p" \
        --hardware "$OUT/profile_${N}t.json" 2>&1 | sed -n '4,11p;19p'
done
say "calibrated"

timeout 120 python3 bench/step_profile.py --configs 4x256 --precision both --steps 2 --top 12 \
    > "$OUT/step_profile_${N}t.txt" 2>&1
grep -E "^\(|^linear|^adamw|^attention|not in ops" "$OUT/step_profile_${N}t.txt"
cp bench/results/step_profile.json "$OUT/step_profile_${N}t.json" 2>/dev/null
timeout 150 python3 bench/step_profile.py --configs 4x256 --precision both --steps 1 --top 12 \
    --threads 1 > "$OUT/step_profile_1t.txt" 2>&1
grep -E "^\(|^linear|^adamw|^attention|not in ops" "$OUT/step_profile_1t.txt"
cp bench/results/step_profile.json "$OUT/step_profile_1t.json" 2>/dev/null
say "profiled"

counts=$(python3 -c "n=$N; c=[n]; k=1
while k < n: c.append(k); k*=2
print(','.join(map(str, sorted(set(c), reverse=True))))")
left=$(( 540 - ($(date +%s) - T0) ))
timeout "$left" python3 bench/thread_scan.py --threads "$counts" --configs 4x256 --steps 3 \
    > "$OUT/thread_scan.txt" 2>&1
grep -E "threads done|^ *[0-9]+ +[0-9]+ +[0-9]+ " "$OUT/thread_scan.txt" | tail -12
cp bench/results/thread_scan.json bench/results/thread_scan.png "$OUT/" 2>/dev/null
say "done"
