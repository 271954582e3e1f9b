"""tree/show.py and round/round_dump.py: a real reference-engine round and a dumped
server round become the same record, a text outline and a picture."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from sglang_ddtree.round.round_dump import RoundDump
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.show import (
    LEGEND,
    accepted_path,
    draw_round,
    format_q,
    from_round,
    layout,
    main,
    picture_positions,
    read_dump,
    render_picture,
    render_text,
)
from sglang_ddtree.tree.testing import random_build_inputs


@pytest.fixture(scope="module")
def engine_round(tmp_path_factory):
    """(record, tokenizer) of the second round of the shipped pair on a code prompt."""
    from sglang_ddtree import DEMO_PAIR_DIR
    from sglang_ddtree.reference.engine import generate, load_pair

    target, drafter, tok = load_pair(DEMO_PAIR_DIR / "target", DEMO_PAIR_DIR / "draft")
    rounds = []
    ids = tok("def fibonacci(n):", add_special_tokens=False)["input_ids"]
    generate(
        target,
        drafter,
        ids,
        12,
        budget=15,
        topk=4,
        on_round=lambda r: rounds.append(from_round(r.tree, r.accept)),
    )
    return rounds[1], tok


def test_an_engine_round_renders_as_text_and_svg(engine_round, tmp_path):
    record, tok = engine_round
    assert record["width"] == 16 and len(record["tokens"]) == 16
    assert record["q"][0] == 1.0 and all(0 < q <= 1 for q in record["q"])
    assert record["accepted"][0] == 0
    for parent, child in zip(record["accepted"], record["accepted"][1:], strict=False):
        assert record["parents"][child] == parent  # the accepted path is a root path
    decode = lambda t: tok.decode([t])  # noqa: E731
    text = render_text(record, decode)
    assert text.splitlines()[0].startswith("16 nodes, ")
    assert sum(line.startswith("*") for line in text.splitlines()) == len(record["accepted"])
    assert f"{decode(record['bonus'])!r} (bonus)" in text
    out = render_picture(record, tmp_path / "round.svg", decode)
    svg = out.read_text()
    assert svg.startswith("<?xml") and "<svg" in svg and "bonus" in svg
    assert render_picture(record, tmp_path / "round.png").read_bytes()[:4] == b"\x89PNG"


def test_layout_puts_nodes_by_depth_and_parents_between_their_children():
    parents = [-1, 0, 0, 1, 1, 2]
    pos = layout(parents)
    assert [pos[i][0] for i in range(6)] == [0, 1, 1, 2, 2, 2]
    assert pos[1][1] == (pos[3][1] + pos[4][1]) / 2 and pos[2][1] == pos[5][1]
    assert sorted(pos[i][1] for i in (3, 4, 5)) == [0, 1, 2]  # leaves on their own rows


def _record(parents: list[int], accepted: list[int]) -> dict:
    n = len(parents)
    return {
        "tokens": list(range(100, 100 + n)),
        "parents": parents,
        "q": [1.0] + [0.5] * (n - 1),
        "accepted": accepted,
        "bonus": 7,
        "width": n,
    }


@pytest.mark.parametrize(
    "parents, accepted",
    [
        ([-1, 0, 1], [0, 1]),  # the accepted node's only child sits on its row
        ([-1, 0, 0, 1, 1, 1], [0, 1]),  # its middle child sits on its row
        ([-1, 0, 1, 2], [0, 1, 2, 3]),  # a leaf accepted: the bonus one column further
    ],
)
def test_the_bonus_covers_no_node(parents, accepted):
    pos = picture_positions(_record(parents, accepted))
    bonus = len(parents)
    assert len(set(pos.values())) == len(pos) == len(parents) + 1  # every box its own place
    assert pos[bonus][0] == pos[accepted[-1]][0] + 1  # one level below the deepest accepted


def test_the_picture_has_a_legend():
    import matplotlib.pyplot as plt

    fig = draw_round(_record([-1, 0, 0, 1], [0, 1]))
    legend = fig.axes[0].get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == list(LEGEND)
    assert any("bonus" in text for text in LEGEND) and any("q" in text for text in LEGEND)
    plt.close(fig)


def _small_q_record() -> dict:
    record = _record([-1, 0, 1, 2, 0], [0, 1])
    record["q"] = [1.0, 0.439, 0.0031, 4.2e-7, 0.0]
    return record


def test_the_root_is_labelled_the_last_committed_token_in_text_and_picture():
    import matplotlib.pyplot as plt

    record = _small_q_record()
    root_line = render_text(record).splitlines()[1]
    assert root_line == "* '100' (root: the last committed token, not drafted)"
    fig = draw_round(record)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "'100'\nroot" in labels
    assert any(text.startswith("root: the last committed token (not drafted)") for text in LEGEND)
    plt.close(fig)


def test_small_path_probabilities_stay_legible():
    """q of a deep node is often below 0.005: it read 0.00 in the picture and 0.000 in the
    text. Significant digits, scientific notation below 1e-4."""
    import matplotlib.pyplot as plt

    assert [format_q(q) for q in (0.439, 0.0031, 4.2e-7)] == ["0.439", "0.0031", "4.2e-07"]
    assert format_q(0.43917, 2) == "0.44"
    record = _small_q_record()
    text = render_text(record)
    for shown in ("(q=0.439)", "(q=0.0031)", "(q=4.2e-07)"):
        assert shown in text, text
    assert "0.000" not in text
    fig = draw_round(record)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert ["'101'\n0.44", "'102'\n0.0031", "'103'\n4.2e-07"] == labels[1:4]
    assert not any(label.endswith("\n0.00") for label in labels)
    plt.close(fig)


def test_a_dumped_server_round_renders_like_an_engine_round(tmp_path):
    """RoundDump on host tensors (the worker's call, minus CUDA): the JSON lines carry the tree
    and the emitted tokens; read_dump recovers the accepted path the accept walk took."""
    gen = torch.Generator().manual_seed(3)
    root, ids, lps = random_build_inputs(gen, 2, 5, 3, 50, "continuous")
    tree = build_tree_reference(root, ids, lps, 11)  # [2, 12]

    def root_path(b: int, node: int) -> list[int]:
        path = [node]
        while path[-1]:
            path.append(int(tree.parents[b, path[-1]]))
        return path[::-1]

    paths = [root_path(0, 9), root_path(1, 2)]  # what two accept walks could have taken
    assert len(paths[0]) >= 3
    B = 6
    emitted = torch.full((2, B), -1, dtype=torch.int64)
    lens = torch.tensor([len(p) for p in paths])
    for b, path in enumerate(paths):  # accepted drafts, then a bonus token
        emitted[b, : len(path)] = torch.tensor([*tree.tokens[b, path[1:]].tolist(), 7])
    dump = RoundDump(tmp_path / "rounds.jsonl", every=2)
    for _ in range(4):  # rounds 2 and 4 are sampled
        dump.round(tree.tokens, tree.parents, tree.scores, emitted, lens)
    dump.close()
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], r["request"]) for r in rows] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    records = read_dump(tmp_path / "rounds.jsonl")
    assert [r["accepted"] for r in records[:2]] == paths and records[0]["bonus"] == 7
    assert records[0]["q"] == pytest.approx(tree.scores[0].exp().tolist())
    assert main([str(tmp_path / "rounds.jsonl"), "--out", str(tmp_path / "pics")]) == 0
    assert len(list((tmp_path / "pics").glob("round_*.svg"))) == 4


def test_the_dump_is_off_unless_asked_and_refuses_a_bad_interval(monkeypatch, tmp_path):
    from sglang_ddtree.config import Options

    monkeypatch.delenv("SGLANG_DDTREE_DUMP_ROUNDS", raising=False)
    assert RoundDump.from_options(Options.from_env()) is None
    monkeypatch.setenv("SGLANG_DDTREE_DUMP_ROUNDS", str(tmp_path / "d.jsonl"))
    dump = RoundDump.from_options(Options.from_env())
    assert dump is not None and dump.every == 100
    dump.close()
    monkeypatch.setenv("SGLANG_DDTREE_DUMP_EVERY", "often")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_DUMP_EVERY must be a whole number"):
        Options.from_env()
    monkeypatch.setenv("SGLANG_DDTREE_DUMP_EVERY", "0")
    with pytest.raises(ValueError, match=">= 1"):
        Options.from_env()


def test_an_emitted_token_off_the_tree_is_an_error():
    with pytest.raises(ValueError, match="no child of node 0"):
        accepted_path([5, 6, 7], [-1, 0, 0], [9, 1])


def _round_tensors():
    gen = torch.Generator().manual_seed(5)
    root, ids, lps = random_build_inputs(gen, 2, 5, 3, 50, "continuous")
    tree = build_tree_reference(root, ids, lps, 11)
    emitted = torch.zeros(2, 6, dtype=torch.int64)
    return tree.tokens, tree.parents, tree.scores, emitted, torch.tensor([2, 1])


def test_a_dump_that_cannot_write_logs_once_turns_off_and_never_blocks(tmp_path, caplog):
    """An unwritable path and a full disk (/dev/full): one warning, the dump off, rounds and
    close return at once."""
    blocked = tmp_path / "a file"
    blocked.write_text("")
    targets = [blocked / "rounds.jsonl"]
    if Path("/dev/full").exists():
        targets.append(Path("/dev/full"))
    for target in targets:
        caplog.clear()
        dump = RoundDump(target, every=1, max_pending=2)
        with caplog.at_level("WARNING"):
            for _ in range(50):
                dump.round(*_round_tensors())
            t0 = time.time()
            dump.close(timeout=5)
        assert time.time() - t0 < 5 and not dump._thread.is_alive(), target
        assert not dump.on and caplog.text.count("the round dump stopped") == 1, target


def test_the_dump_stops_at_its_size_cap(tmp_path, caplog):
    path = tmp_path / "rounds.jsonl"
    path.write_text("x" * 100)  # an existing file counts
    dump = RoundDump(path, every=1, max_bytes=1000)
    with caplog.at_level("WARNING"):
        for _ in range(40):
            dump.round(*_round_tensors())
            time.sleep(0.01)
        dump.close()
    size = path.stat().st_size
    one_round = 2 * 400  # two requests' lines, about 330 characters each
    assert 1000 <= size <= 1000 + one_round, size
    assert caplog.text.count("reached its cap of 1000 bytes") == 1 and not dump.on


def test_close_waits_at_most_its_timeout_for_a_stuck_writer(tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    monkeypatch.setattr(RoundDump, "_write_round", staticmethod(lambda *a: release.wait() or 0))
    dump = RoundDump(tmp_path / "rounds.jsonl", every=1, max_pending=1)
    for _ in range(5):  # the writer takes one and hangs; the queue fills; the rest are skipped
        dump.round(*_round_tensors())
    t0 = time.time()
    dump.close(timeout=0.3)
    assert time.time() - t0 < 2
    release.set()


def test_the_same_round_draws_the_same_bytes(tmp_path):
    """Regenerated pictures (docs/trees) change only when the round does."""
    record = _record([-1, 0, 0, 1], [0, 1])
    first = render_picture(record, tmp_path / "a.svg").read_bytes()
    assert render_picture(record, tmp_path / "b.svg").read_bytes() == first
    assert b"<dc:date>" not in first
    png = render_picture(record, tmp_path / "a.png").read_bytes()
    assert render_picture(record, tmp_path / "b.png").read_bytes() == png
