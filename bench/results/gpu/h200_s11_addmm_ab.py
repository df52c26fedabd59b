"""The eleventh session's A/B of one-row GEMMs on the H200 (lines: h200_s11_addmm_ab.jsonl).

One process per form, alternating: decode tok/s of our ``stream_generate`` and
of mlx-lm's ``generate_step`` (the control: the host's speed differs between
processes) on the *large* bf16 install, 3 timed requests of 128 tokens after a
2,048-token prompt and one warm-up request each. ``ADDMM=split`` makes every
one-row ``mx.addmm`` a matmul and an add (what ``stacked.gemm_add`` now does on
a GPU); unset, main at ``353dae4`` as it was (``addmm``, cuBLASLt).

Run on the machine: ``ADDMM=split python3 bench/results/gpu/h200_s11_addmm_ab.py qwen_gdn``.
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx

if os.environ.get("ADDMM") == "split":
    real = mx.addmm

    def addmm(c, a, b, alpha=1.0, beta=1.0, **kw):
        if a.shape[-2] == 1:
            out = a @ b
            if alpha != 1.0:
                out = out * alpha
            return c + out if beta == 1.0 else beta * c + out
        return real(c, a, b, alpha=alpha, beta=beta, **kw)

    mx.addmm = addmm

from mlx_lm.utils import load_model

from bench.common import install, random_tokens
from bench.forward import _ours_generate, _theirs_generate
from turbospark.generation.runner import Runner

family = sys.argv[1]
path = install(family, "large", "bfloat16", Path.home() / ".cache/turbospark/bench")
runner = Runner.open(path, context_length=4096)
model, _ = load_model(path)
prompt = random_tokens(2048, runner.vocab_size, seed=0)
ours = _ours_generate(runner, path, prompt, 128, 512)
theirs = _theirs_generate(model, prompt, 128, 512)
ours()
theirs()
o, t = [], []
for _ in range(3):
    o.append(128 / ours()["decode_s"])
    t.append(128 / theirs()["decode_s"])
line = {
    "family": family,
    "form": os.environ.get("ADDMM", "addmm"),
    "ours": sorted(round(x, 1) for x in o),
    "mlx_lm": sorted(round(x, 1) for x in t),
    "ratio_of_medians": round(statistics.median(o) / statistics.median(t), 3),
}
print(json.dumps(line), flush=True)
