"""scripts/results_page.py: docs/results.md and the README's blocks are what the data files
say, every data file is a section with its provenance, and new rows become the next sitting."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import results_page as page  # noqa: E402


def test_the_page_and_the_readme_blocks_are_generated_from_the_data(capsys):
    assert page.main(["--check"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "data").glob("*.jsonl")), ids=str)
def test_every_data_file_is_a_section_and_every_row_says_where_it_came_from(path):
    assert path.stem in {s.name for s in page.SECTIONS}, f"{path.name} has no Section"
    rows = page.read_rows(path.stem)
    assert rows
    for row in rows:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", row["commit"]), row
        assert isinstance(row["sitting"], int) and row["sitting"] >= 1, row
    order = [(r["sitting"], r["date"]) for r in rows]
    assert order == sorted(order), "sittings are appended in order, dates never go back"


def test_no_session_or_issue_numbers_in_the_data():
    for path in (ROOT / "docs" / "data").glob("*.jsonl"):
        assert not re.search(r"[Ss]ession \d|[Ii]ssue \d", path.read_text()), path.name


def test_add_stamps_rows_as_the_next_sitting(tmp_path):
    new = [{"bs": 1, "round_ms": 20.0}, {"bs": 8, "round_ms": 30.0}]
    first = page.add_rows(
        "x", new, "abc1234", "python scripts/bench_round.py --out OUT", "2026-12-05", data=tmp_path
    )
    dated = {"bs": 1, "round_ms": 21.0, "date": "2026-12-06", "commit": "def5678"}
    second = page.add_rows("x", [dated], None, None, None, data=tmp_path)
    rows = page.read_rows("x", tmp_path)
    assert rows == first + second
    assert [(r["sitting"], r["date"], r["commit"]) for r in rows] == [
        (1, "2026-12-05", "abc1234"),
        (1, "2026-12-05", "abc1234"),
        (2, "2026-12-06", "def5678"),
    ]
    assert list(rows[0])[:4] == ["date", "commit", "sitting", "command"]
    assert "command" not in rows[2]
    with pytest.raises(SystemExit, match="pass --commit"):
        page.add_rows("x", new, None, None, None, data=tmp_path)


def _run(server: str, run: int, tok_s: float, **extra) -> dict:
    return {
        "sitting": 1,
        "date": "2026-12-05",
        "temperature": 0.0,
        "concurrency": 1,
        "server": server,
        "run": run,
        "output_throughput": tok_s,
        "accept_length": 2.0,
        **extra,
    }


def test_the_serving_ratio_is_the_geometric_mean_of_run_by_run_ratios():
    """Each run's tok/s over DFLASH's in the same run: a slow run common to both cancels."""
    rows = [
        _run("dflash", 1, 100.0),
        _run("dflash", 2, 50.0),
        _run("ddtree", 1, 120.0),
        _run("ddtree", 2, 40.0),
        _run("none", 1, 300.0, accept_length=None),
        _run("none", 2, 100.0, accept_length=None),
    ]
    text = page.serving_table(rows)
    line = next(x for x in text.splitlines() if "| ddtree |" in x)
    assert f"| {math.sqrt(1.2 * 0.8):.2f} (0.80-1.20) |" in line
    assert "| 80 (40-120) | 2.00 |" in line  # the median tok/s and accept length
    plain = next(x for x in text.splitlines() if "| none |" in x)
    assert f"| 200 (100-300) |  | {math.sqrt(3.0 * 2.0):.2f} (2.00-3.00) |" in plain
    dflash = next(x for x in text.splitlines() if "| dflash |" in x)
    assert dflash.endswith("| 2.00 |  |")  # no ratio of DFLASH to itself


def test_latest_is_the_newest_sitting_that_measured_the_key():
    rows = [{"sitting": 1, "a": 1}, {"sitting": 2, "b": 2}, {"sitting": 2, "a": 3}]
    assert page.latest(rows) == rows[1:]
    assert page.latest([{"sitting": 1, "a": 1}, {"sitting": 2, "b": 2}], "a") == [
        {"sitting": 1, "a": 1}
    ]
    assert page.latest(rows, "c") == []


def test_a_declared_section_without_rows_says_so(tmp_path):
    section = page.SECTIONS[0]
    assert page.render_section(section, data=tmp_path).endswith("No rows yet.")


def test_the_readme_blocks_are_replaced_and_the_rest_kept(tmp_path):
    rows = [
        {
            "date": "2026-12-05",
            "commit": "abc1234",
            "sitting": 1,
            "variant": v,
            "bs": 1,
            "round_ms": ms,
        }
        for v, ms in (("dflash", 20.0), ("ddtree32_auto", 18.0))
    ]
    (tmp_path / "round_cost_27b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = "intro\n<!-- results:round_cost_27b -->\nold table\n<!-- /results -->\nafter\n"
    out = page.render_readme(text, data=tmp_path)
    assert out.startswith("intro\n<!-- results:round_cost_27b -->\nMeasured 2026-12-05")
    assert "| 1 | 20.00 | 18.00 | 0.90 |" in out and "old table" not in out
    assert out.endswith("<!-- /results -->\nafter\n")


def test_a_long_command_is_wrapped_into_the_same_shell_words():
    command = (
        "python scripts/bench_gdn_tree.py --out OUT --bs 1,8,16 --nodes 16,32,64 --conv "
        "--conv-tilings t1n256w2in,t2n256w2in,t2n256w4in --chunk-tiles 16x4xsplit,64x4xsplit"
    )
    text = page._wrap(command, width=60)
    lines = text.splitlines()
    assert len(lines) > 1 and all(line.startswith("    ") for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])
    assert " ".join(line.rstrip("\\").strip() for line in lines).split() == command.split()
    assert not any(line.rstrip(" \\").endswith("--bs") for line in lines)  # a flag keeps its value


def test_the_fresh_clone_sentence_gives_the_times_and_the_load(tmp_path):
    row = {
        "date": "2026-12-05",
        "commit": "abc1234",
        "sitting": 1,
        "machine": {"cpus": 2, "memory_gb": 24},
        "load_mean": {"setup": 0.5, "demo": 1.0, "test": 3.2},
        "setup_s": 117.4,
        "demo_s": 11.6,
        "test_s": 420.0,
    }
    (tmp_path / "fresh_clone.jsonl").write_text(json.dumps(row) + "\n")
    text = " ".join(page.readme_block("fresh_clone", tmp_path).split())
    assert text == (
        "Measured on a fresh clone (2026-12-05, a 2-CPU machine, load average "
        "0.5 / 1 / 3.2 during them: shared with other work): setup 117 s, the demo "
        "12 s, the tests 7.0 min (`scripts/time_fresh_clone.sh`)."
    )
    # a load within the machine's CPUs is the steps' own work: not called shared
    row["load_mean"] = {"setup": 0.6, "demo": 1.0, "test": 1.0}
    (tmp_path / "fresh_clone.jsonl").write_text(json.dumps(row) + "\n")
    text = " ".join(page.readme_block("fresh_clone", tmp_path).split())
    assert text.startswith(
        "Measured on a fresh clone (2026-12-05, a 2-CPU machine, load average "
        "0.6 / 1 / 1 during them): setup 117 s"
    )


def test_the_dflash2_sentence_reads_the_newest_sitting_at_32_nodes(tmp_path):
    def row(sitting, drafter, nodes, tokens):
        return {
            "date": f"2026-12-0{sitting}",
            "commit": "abc1234",
            "sitting": sitting,
            "drafter": drafter,
            "nodes": nodes,
            "tokens_per_round": tokens,
            "blocks": 64,
        }

    rows = [row(1, "dflash_chain", None, 9.0)] + [
        row(2, d, n, t)
        for d, n, t in [
            ("dflash_chain", None, 1.25), ("dflash2_chain", None, 1.5),
            ("ddtree_marginal", 16, 1.0), ("ddtree_marginal", 32, 2.0),
            ("ddtree_lattice", 32, 2.2), ("ddtree_lattice_coverage", 32, 2.5),
            ("ddtree_lattice_coverage", 64, 9.0),
        ]
    ]  # fmt: skip
    path = tmp_path / "dflash2_offline_pair.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = " ".join(page.readme_block("dflash2_offline_pair", tmp_path).split())
    assert text == (
        "Offline on the shipped pair (2026-12-02, temperature 0, 64 held-out blocks, N = 32), "
        "tokens per round: the DFlash chain 1.25; the DFlash2 chain 1.50 (1.20x); DDTREE's "
        "marginal tree 2.00 (1.60x); DDTREE's lattice tree 2.50 (2.00x) (docs/results.md)."
    )


def test_the_simulated_serving_table_gives_ratios_round_times_and_widths_per_run():
    world = {
        "name": "narrative",
        "top1": [0.7315],
        "spread": 0.5,
        "ratio": 0.5,
        "off_spine": 0.3,
        "seed": 0,
    }
    base = {
        "date": "2026-12-05",
        "commit": "abc1234",
        "sitting": 1,
        "sglang": "0.5.23",
        "simulate": world,
        "command": "python scripts/bench_round.py --out OUT",
    }

    def row(variant, c, tok_s, tpot, accept, running, **extra):
        return {
            **base,
            "variant": variant,
            "concurrency": c,
            "output_tok_s": tok_s,
            "median_tpot_ms": tpot,
            "accept_len": accept,
            "max_running": running,
            **extra,
        }

    rows = [
        row("dflash", 1, 100.0, 6.0, 3.5, 16),
        row("dflash", 8, 500.0, 10.0, 3.6, 16),
        row("ddtree32_auto", 1, 120.0, 5.0, 4.0, 32, widths_rounds={"16": 5, "32": 40}),
        row("ddtree32_auto", 8, 600.0, 9.0, 4.0, 32, widths_rounds={"16": 65, "32": 50}),
    ]
    text = page.serving_simulated_table(rows)
    words = " ".join(text.split())  # the prose is wrapped
    assert "SGLang 0.5.23" in words and "`narrative` world" in words and "off-spine 0.3" in words
    assert "Running requests at most: dflash 16; ddtree32_auto 32." in words
    body = [
        line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| 1 ") or line.startswith("| 8 ")
    ]
    assert body[0][3] == "1.20" and body[1][3] == "1.20"  # tok/s over DFLASH's, same c
    assert body[0][8:10] == ["21.0", "20.0"]  # ms per round = TPOT x tokens per round
    assert body[0][10].rstrip(" |") == "16 x 5, 32 x 40"
    assert body[1][10].rstrip(" |") == "16 x 60, 32 x 10"  # this run's rounds alone
    # rows whose widths came from a lagging log table: no per-run column, the last count said
    old = [{**r, "widths_chosen": "16 x 7, 32 x 9"} for r in rows]
    for r in old:
        r.pop("widths_rounds", None)
    text = page.serving_simulated_table(old)
    assert "widths x rounds" not in text
    assert "as its log last counted: 16 x 7, 32 x 9" in " ".join(text.split())


def test_a_steady_state_sitting_shows_r_x_t_the_prefill_share_and_the_spread():
    """bench_round.py --steady-state rows: a line per (c, server) from its runs (the probes not
    shown), tok/s the runs' median over DFLASH's, R x T ("capped" where the cap lowered it),
    the median prefill share measured, the cell's spread row's spread, and an automatic
    server's widths over its runs alone (the probes' rounds come off)."""
    base = {"date": "2026-12-06", "commit": "abc1234", "sitting": 2, "sglang": "0.5.23"}
    base |= {"command": "python scripts/bench_round.py --out OUT --steady-state"}

    def run(variant, c, run, tok_s, share, capped=False, **extra):
        return {
            **base,
            "mode": "steady",
            "variant": variant,
            "concurrency": c,
            "run": run,
            "output_tok_s": tok_s,
            "median_tpot_ms": 10.0,
            "accept_len": 4.0,
            "max_running": 16,
            "requests_per_client": 10,
            "tokens": 900 if capped else 456,
            "prefill_ms": 60.0,
            "prefill_share": share,
            "prefill_share_limit": 0.05,
            "capped": capped,
            **extra,
        }

    def spread(variant, c, value):
        cell = {"variant": variant, "concurrency": c, "max_running": 16, "spread": value}
        return {**base, "kind": "spread", "mode": "steady", **cell}

    auto = "ddtree32_auto"
    rows = [
        {**run("dflash", 4, 0, 1.0, 0.2), "mode": "probe"},
        run("dflash", 4, 1, 100.0, 0.04),
        run("dflash", 4, 2, 110.0, 0.05),
        spread("dflash", 4, 0.0952),
        {**run(auto, 4, 0, 1.0, 0.2), "mode": "probe", "widths_rounds": {"16": 10}},
        run(auto, 4, 1, 120.0, 0.04, capped=True, widths_rounds={"16": 30, "32": 5}),
        run(auto, 4, 2, 130.0, 0.03, capped=True, widths_rounds={"16": 40, "32": 25}),
        spread(auto, 4, 0.08),
    ]
    text = page.serving_simulated_table([{**r, "sitting": 1, "mode": None} for r in rows] + rows)
    words = " ".join(text.split())
    assert "Steady state (`--steady-state`)" in words and "under 5.0% of a run" in words
    lines = [line.split(" | ") for line in text.splitlines() if line.startswith("| 4 ")]
    assert [line[1] for line in lines] == ["dflash", auto]  # no probe line
    dflash, tree = lines
    assert dflash[2:6] == ["2", "105", "9.5%", ""] and dflash[9:11] == ["10 x 456", "4.5%"]
    assert tree[3:6] == ["125", "8.0%", "1.19"] and tree[8] == "40.0"  # 125 / 105; TPOT x 4
    assert tree[9] == "10 x 900 capped" and tree[10] == "3.5%"
    assert tree[11].rstrip(" |") == "16 x 30, 32 x 25"  # 20 + 10 of 16, 5 + 20 of 32
    # an older short sitting still renders as before
    short = [{k: v for k, v in r.items() if k not in ("mode", "run")} for r in rows[1:2]]
    assert "Steady state" not in page.serving_simulated_table(short)


def test_the_round_cost_table_names_the_method_startup_and_what_did_not_fit():
    base = {"date": "2026-12-05", "commit": "abc1234", "sitting": 1, "sglang": "0.5.23"}
    start = {"healthy_s": 226.6, "target_verify": 40.17, "draft_decode": 38.53}
    rows = [
        {
            **base,
            "variant": "dflash",
            "bs": 1,
            "round_ms": 20.0,
            "method": "slope",
            "startup": start,
        },
        {**base, "variant": "dflash", "bs": 32, "error": "does not fit: at most 16"},
        {
            **base,
            "variant": "ddtree32_auto",
            "bs": 1,
            "round_ms": 19.0,
            "method": "slope",
            "startup": {"healthy_s": 71.9, "target_verify": 12.08, "draft_decode": 2.98},
        },
        {**base, "variant": "ddtree32_auto", "bs": 32, "round_ms": -3.0, "method": "slope"},
    ]
    text = page.round_cost_table(rows)
    words = " ".join(text.split())
    assert "dummy weights' (about one token a round)" in words
    assert "Round time: the slope of latency against rounds." in words
    assert "dflash 227 s (40 s, 39 s); ddtree32_auto 72 s (12 s, 3 s)" in words
    assert "| 1 | 20.00 | 19.00 | 0.95 |" in text
    assert "| 32 | does not fit | - |  |" in text


def test_help_says_how_to_regenerate(capsys):
    with pytest.raises(SystemExit) as done:
        page.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--check" in out and "add NAME ROWS.jsonl" in out and "docs/data" in out
    assert page.main(["--check"]) == 0  # --help wrote nothing


def test_add_takes_a_command_beside_its_own_name():
    """`add`'s --command is the rows' command, not the subcommand's name."""
    args = page.parser().parse_args(
        ["add", "x", "rows.jsonl", "--commit", "abc1234", "--command", "python scripts/a.py"]
    )
    assert (args.action, args.command, args.commit) == ("add", "python scripts/a.py", "abc1234")
    assert page.parser().parse_args([]).action is None


def test_the_readme_stays_short():
    """The README is for users: under 12,000 characters, no line over 300 (tables included)."""
    text = page.README.read_text()
    assert len(text) < 12_000, len(text)
    long = [(i, len(line)) for i, line in enumerate(text.splitlines(), 1) if len(line) > 300]
    assert long == []
