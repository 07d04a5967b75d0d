#!/usr/bin/env bash
# One launch of the 8-bit attention kernel (compiler/kernels/int8_attention.py) at the Wan 1.3B
# shape (1 x 32,760 x 12 x 128, fp16) under ncu: the full section set with SASS stall sampling,
# clocks left alone. On the GPU machine, from the checkout root with the bundle:
#   source .devbundle/install.sh && bash benchmarks/ncu_attn.sh
# OUT gets ncu_details.txt (the details page), ncu_sass.csv (the SASS source page: per instruction,
# its stall samples by reason and executions) and ncu_run.txt.
# VARIANT=<name of a benchmarks/sage_ab.py variant> profiles that build of the kernel instead (built
# first, outside ncu), on the same shape and the same quantised inputs as the job's.
set -u
OUT=${OUT:?set OUT to a folder}
python3 -c "from compiler.kernels.int8_attention import unavailable; print('kernel:', unavailable())"
SO=""
if [ -n "${VARIANT:-}" ]; then
    # variants with 128-key blocks only (the k64 ones take other K scales); a failed build stops here
    SO=$(python3 -c "import sys, tempfile; sys.path.insert(0, 'benchmarks'); import sage_ab
v = sys.argv[1]
if sage_ab.VARIANTS.get(v, (0, 0))[1] != 128:
    sys.exit(f'ncu_attn.sh: VARIANT={v}: not a sage_ab.py variant with 128-key blocks')
print(sage_ab._build(v, tempfile.mkdtemp()))" "$VARIANT" | tail -1)
    [ -f "$SO" ] || { echo "ncu_attn.sh: no build of VARIANT=$VARIANT" >&2; exit 1; }
    echo "variant $VARIANT: $SO"
fi
cat > /tmp/a8.py <<'PY'
import sys
import torch
from compiler.kernels.int8_attention import attention8, quantize
q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.float16) for _ in range(3))
if len(sys.argv) > 1:          # a sage_ab.py build: its entry point on the job's quantised inputs
    sys.path.insert(0, "benchmarks")
    import sage_ab
    m, o, qkv8 = sage_ab._load(sys.argv[1]), torch.empty_like(q), quantize(q, k, v)
    run = lambda: sage_ab.launch(m, *qkv8, o)
else:
    run = lambda: attention8(q, k, v)
for _ in range(3):
    run()
torch.cuda.synchronize()
PY
ncu --clock-control none -k regex:qk_int8_sv_f8_attn_kernel -s 2 -c 1 --set full --import-source no -o /tmp/a8 python3 /tmp/a8.py $SO > $OUT/ncu_run.txt 2>&1
ncu -i /tmp/a8.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu -i /tmp/a8.ncu-rep --page source --csv --print-source sass > $OUT/ncu_sass.csv 2>&1
# the SASS page summed (ncu_sass_summary.txt): stall samples by reason, the instructions with the
# most samples, the executed instruction mix a warp and tile (6,144 CTAs x 4 warps x 256 key tiles
# at this shape; the same count of computing warps and tiles in the warp-specialised variants,
# 3,072 CTAs x 8, whose loader warp's instructions it then includes)
python3 - "$OUT/ncu_sass.csv" > "$OUT/ncu_sass_summary.txt" <<'PY'
import collections, csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr, data = rows[1], rows[2:]
stall = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
tot = collections.Counter()
for r in data:
    for i in stall:
        tot[hdr[i]] += int(r[i] or 0)
s = sum(tot.values())
print("stall reason, samples, share")
for k, v in tot.most_common(12):
    print(f"{k:28} {v:8} {100 * v / s:5.1f}%")
si = hdr.index("Warp Stall Sampling (All Samples)")
print("\ninstructions with the most samples (samples, SASS, top reasons)")
for j in sorted(range(len(data)), key=lambda j: -int(data[j][si] or 0))[:12]:
    r = data[j]
    det = sorted({hdr[i]: int(r[i]) for i in stall if r[i] not in ("", "0")}.items(), key=lambda x: -x[1])[:2]
    print(r[si].rjust(7), r[1].strip()[:60].ljust(60), det)
ei = hdr.index("Instructions Executed")
mix = collections.Counter()
for r in data:
    op = r[1].strip().split()
    if op:
        mix[(op[1] if op[0].startswith("@") else op[0]).split(".")[0]] += int(r[ei] or 0)
S, per = sum(mix.values()), 6144 * 4 * 256
print(f"\nexecuted warp instructions {S}, {S / per:.1f} a warp and tile")
for k, v in mix.most_common(16):
    print(f"{k:10} {v / per:8.1f} a warp and tile {100 * v / S:5.1f}%")
PY
ls -la $OUT; grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Compute \(SM\) Throughput|Tensor" $OUT/ncu_details.txt | head -40
