"""Issue 15, parts 1 and 4, on the GPU: the mixed soak (scripts/soak.py) and the fuzzed bad
requests (scripts/fuzz_requests.py) against DDTREE (default options) and DFLASH on the shipped
pair, each server started here with the suite's flags and SGLang's idle memory check. Bounded:
at most SOAK_S seconds of traffic per server, to 127.0.0.1 only. Run alone:

    python -m pytest tests/gpu/test_soak.py -m soak -q -rA

(it is skipped unless `-m` names `soak`). The report goes to $OUT/soak_report.json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from tests.fixtures import load_script  # noqa: E402
from tests.gpu import harness  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.soak]

REQUESTS, SOAK_S, CONCURRENCY = 1000, 140, 32  # twice the suite's --max-running-requests 16
CONTEXT = 2048  # the suite's --context-length


@pytest.fixture
def selected(request):
    if "soak" not in (request.config.getoption("-m") or ""):
        pytest.skip("the soak runs only when asked for: -m soak")


def test_a_mixed_soak_and_fuzzed_bad_requests_leave_ddtree_and_dflash_serving(selected,
                                                                              tmp_path):  # fmt: skip
    from tests.gpu.servers import COMMON, DEMO, ENV, ddtree_args, dflash_args

    soak, fuzz = load_script("soak"), load_script("fuzz_requests")
    flags = {"ddtree": ddtree_args("pair", DEMO / "draft"), "dflash": dflash_args(DEMO / "draft")}
    servers = {name: harness.Server(f"soak-{name}", str(DEMO / "target"),
                                    harness.free_port(35000 + 100 * i), [*COMMON, *extra], ENV,
                                    log_dir=tmp_path)
               for i, (name, extra) in enumerate(flags.items())}  # fmt: skip
    reqs = soak.request_mix(REQUESTS, CONTEXT, seed=0)
    report = {}
    try:
        for server in servers.values():
            server.start()
        for name, server in servers.items():
            server.wait_healthy(timeout=600)
            url = server.url
            start = server.log_path.stat().st_size
            before = soak.health(url)
            result = soak.soak(url, reqs, SOAK_S, CONCURRENCY)
            time.sleep(2)  # aborted requests drain
            fuzzed = fuzz.run(url, rounds=2, context=CONTEXT, seed=0)
            time.sleep(2)
            after = soak.health(url)
            report[name] = {
                **result, "fuzz": fuzzed,
                "checks": {"probe_unchanged": before["probe"] is not None
                           and after["probe"] == before["probe"],
                           "healthy": after["healthy"],
                           "kv_idle": after["kv_tokens_in_use"] == 0,
                           "log_problems": soak.log_problems(server.log_path, start)},
            }  # fmt: skip
            print(name, json.dumps({k: v for k, v in report[name].items() if k != "fuzz"}))
            print(name, "fuzz", json.dumps({k: fuzzed[k] for k in ("cases", "bad",
                  "good_text_unchanged", "alive_after", "ok")}))  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
        out = Path(os.environ.get("OUT", "/tmp")) / "soak_report.json"
        out.write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        checks = r["checks"]
        assert r["failed"] == 0, (name, r["errors"])
        assert r["completed"] >= 100 and r["cancelled"] > 0, (name, r)
        assert checks["probe_unchanged"] and checks["healthy"] and checks["kv_idle"], (name, checks)
        assert checks["log_problems"] == [], (name, checks)
        assert r["fuzz"]["ok"], (name, r["fuzz"]["bad"][:5])
    assert set(report) == set(servers)
