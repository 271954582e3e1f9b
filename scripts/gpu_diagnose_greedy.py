"""Where DDTREE's greedy output first differs from the plain server's, how close was the plain
server's own top-2 race there? (Near-ties flip under different bf16 kernel shapes.)

    python scripts/gpu_diagnose_greedy.py BASE_URL SPEC_URL [N_TOKENS]
"""

import json
import sys

from harness import PROMPTS, first_divergence, post  # beside this script (scripts/harness.py)

base_url, spec_url = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 128
rows = []
for i, prompt in enumerate(PROMPTS):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    _, b = post(
        base_url + "/generate",
        {"text": prompt, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2},
    )
    _, s = post(spec_url + "/generate", {"text": prompt, "sampling_params": sp})
    pos = first_divergence(b["output_ids"], s["output_ids"])
    if pos is None:
        rows.append({"prompt": i, "diverge": None})
        continue
    top2 = b["meta_info"]["output_top_logprobs"][pos]
    gap = top2[0][0] - top2[1][0]
    rows.append(
        {
            "prompt": i,
            "diverge": pos,
            "base_tok": b["output_ids"][pos],
            "spec_tok": s["output_ids"][pos],
            "base_top2": [t[1] for t in top2],
            "top2_logprob_gap": round(gap, 5),
        }
    )
print(json.dumps(rows))
gaps = [r["top2_logprob_gap"] for r in rows if r["diverge"] is not None]
second = sum(r["spec_tok"] == r["base_top2"][1] for r in rows if r["diverge"] is not None)
print(
    f"diverged {len(gaps)}/{len(rows)}; spec took base's 2nd choice in {second}; "
    f"max top2 gap at divergence {max(gaps) if gaps else None}"
)
