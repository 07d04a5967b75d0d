#!/usr/bin/env bash
# One launch of the 8-bit attention kernel (compiler/kernels/int8_attention.py) at the Wan 1.3B
# shape (1 x 32,760 x 12 x 128, fp16) under ncu: the full section set with SASS stall sampling,
# clocks left alone. On the GPU machine, from the checkout root with the bundle:
#   source .devbundle/install.sh && bash benchmarks/ncu_attn.sh
# OUT gets ncu_details.txt (the details page), ncu_sass.csv (the SASS source page: per instruction,
# its stall samples by reason and executions) and ncu_run.txt.
set -u
OUT=${OUT:?set OUT to a folder}
python3 -c "from compiler.kernels.int8_attention import unavailable; print('kernel:', unavailable())"
cat > /tmp/a8.py <<'PY'
import torch
from compiler.kernels.int8_attention import attention8
q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.float16) for _ in range(3))
for _ in range(3):
    attention8(q, k, v)
torch.cuda.synchronize()
PY
ncu --clock-control none -k regex:qk_int8_sv_f8_attn_kernel -s 2 -c 1 --set full --import-source no -o /tmp/a8 python3 /tmp/a8.py > $OUT/ncu_run.txt 2>&1
ncu -i /tmp/a8.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu -i /tmp/a8.ncu-rep --page source --csv --print-source sass > $OUT/ncu_sass.csv 2>&1
ls -la $OUT; grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Compute \(SM\) Throughput|Tensor" $OUT/ncu_details.txt | head -40
