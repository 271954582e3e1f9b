"""Where DDTREE's chunked Gated DeltaNet verify and the root-path kernel part ways in a served
run: one DDTREE server (chunked verify) on the GPU suite's binary Qwen3.5 pair with the GDN
check of tests/gpu/server_debug (DDTREE_GDN_CHECK=OUT/check: every chunked verify checked against
the root-path kernel; in CUDA graphs per round, with --eager per call with the inputs of one
that differs saved), the suite's greedy prompts at c=1, then
each output's largest float32 deficit under the reference engine (did this run serve a wrong
token?).

    python -m tests.gpu.diagnose_gdn OUT [--prompts 0,15] [--eager] [--verify paths]
        [--perturb 0.004] [--precision ieee] [--serve paths] [--save 400]
        (from the checkout: it runs the GPU suite's server for the pair)

--verify paths --perturb EPS serves the root-path kernel (DDTREE_GDN_VERIFY) with its outputs off by up to EPS
(DDTREE_GDN_PERTURB): if the same prompt then serves a wrong token, the model is fragile
there (any other rounding flips it), not the chunked kernel wrong (an EPS below half a bf16
step, about 2e-3, rounds the bf16 outputs back to themselves: a no-op). --precision: the chunked
verify's products (DDTREE_GDN_PRECISION). --serve paths: the check serves the root
paths' outputs with the chunked kernel's scratch (DDTREE_GDN_CHECK_SERVE), so a wrong
token that stays comes from the scratch and one that goes from the outputs. --save N (with
--eager): the inputs and both outputs of the first N verifies, for a float64 replay
(DDTREE_GDN_CHECK_SAVE). --model pair --deterministic --concurrency 1,8: the shipped
pair in SGLang's deterministic mode, the prompts served at each concurrency in turn, and which
prompts' tokens changed between them (the chunked verify's served tokens were once found not
batch-invariant there); with --eager --save N the verifies of both passes are saved in order
(`call` in each file), to find the first input or output that differs.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tests.gpu import harness
from tests.gpu.servers import COMMON, DETERMINISTIC, ENV, NEW_TOKENS, ddtree_args, write_pair


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--prompts", default="", help="indices into harness.PROMPTS (default: all)")
    p.add_argument("--port", type=int, default=33000)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: save differing inputs")
    p.add_argument("--verify", choices=("chunk", "paths"), default="chunk")
    p.add_argument("--perturb", type=float, default=0.0, help="DDTREE_GDN_PERTURB")
    p.add_argument("--precision", default="split", help="DDTREE_GDN_PRECISION (chunk)")
    p.add_argument("--serve", choices=("chunk", "paths"), default="chunk")
    p.add_argument("--save", type=int, default=0, help="with --eager: verifies saved")
    p.add_argument("--model", choices=("qwen35", "pair"), default="qwen35")
    p.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference")
    p.add_argument("--concurrency", default="1", help="serve the prompts at each, in turn")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = write_pair(args.out, args.model)
    # the aids are test tooling: server_debug/sitecustomize.py (on ENV's PYTHONPATH) installs
    # them in the server's processes from the DDTREE_GDN_* variables
    env = {**ENV, "DDTREE_GDN_VERIFY": args.verify, "DDTREE_GDN_PERTURB": str(args.perturb)}
    if args.verify == "chunk":
        env.update(
            {
                "DDTREE_GDN_CHECK": str(args.out / "check"),
                "DDTREE_GDN_PRECISION": args.precision,
                "DDTREE_GDN_CHECK_SERVE": args.serve,
                "DDTREE_GDN_CHECK_SAVE": str(args.save),
            }
        )
    flags = [
        *COMMON,
        *ddtree_args(args.model, draft),
        *(["--disable-cuda-graph"] * args.eager),
        *(DETERMINISTIC * args.deterministic),
    ]
    server = harness.Server(
        f"{args.model}-ddtree_check", str(target), args.port, flags, env, log_dir=args.out
    )
    server.start()
    try:
        server.wait_healthy(600)
        picked = [int(i) for i in args.prompts.split(",") if i] or range(len(harness.PROMPTS))
        passes = {int(c): _serve(server, picked, int(c)) for c in args.concurrency.split(",")}
        rows = next(iter(passes.values()))
        (args.out / "outputs.json").write_text(json.dumps(passes))
    finally:
        server.stop()
    if len(passes) > 1:
        (first, base), *rest = passes.items()
        for c, other in rest:
            moved = [
                (a["prompt"], harness.first_divergence(a["output_ids"], b["output_ids"]))
                for a, b in zip(base, other, strict=True)
                if a != b
            ]
            print(f"concurrency {c} vs {first}: (prompt, first differing token) {moved}")
    log = server.log_text()
    found = re.findall(r"GDN check: (?:verify|round) \d+ .*differs.*", log)
    print(f"{len(found)} chunked verifies (or graph rounds) differed from the root paths")
    print("\n".join(found[:8]))
    print("\n".join(re.findall(r"GDN check: verify \d+: worst difference so far.*", log)[-3:]))
    # did this run serve a wrong token? the float32 referee of the GPU suite, on this machine's
    # checkpoint (seeded weights written here, not bit-equal to another machine's)
    from sglang_ddtree.reference.engine import load_pair

    ref_target = load_pair(str(target), str(draft))[0]
    for row in rows:
        ids = server.tokenize(harness.PROMPTS[row["prompt"]])
        deficits = harness.fp32_deficits(ref_target, ids, row["output_ids"])
        worst = max(range(len(deficits)), key=deficits.__getitem__)
        print(f"prompt {row['prompt']}: largest float32 deficit {deficits[worst]:.3f} at {worst}")
    return 0


def _serve(server, picked, concurrency: int) -> list[dict]:
    """The picked prompts at temperature 0, `concurrency` in flight; rows in prompt order."""

    def one(i: int) -> dict:
        out = harness.generate(
            server, harness.PROMPTS[i], max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
        )
        return {"prompt": i, "output_ids": out["output_ids"]}

    return harness.run_all(one, list(picked), concurrency)


if __name__ == "__main__":
    raise SystemExit(main())
