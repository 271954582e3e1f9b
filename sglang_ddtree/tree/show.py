"""Pictures of DDTree rounds: one round as a record, a compact text rendering, and an SVG/PNG.

A round record (a dict, one JSON line in a dump) holds what a round looked like:

    tokens   [N] int   node 0 = the root (the last committed token), 1.. = drafted tokens
    parents  [N] int   -1 at the root, else the parent's index (< own index)
    q        [N] float the drafter's probability of the root->node path (1 at the root)
    accepted [a+1] int node indices of the accepted path, root first
    bonus    int       the target's token after the deepest accepted node
    width    int       N, the nodes verified that round

The reference engine's rounds (`from_round`) and the server's dumped rounds
(round/round_dump.py, which stores the emitted tokens instead of the path:
`accepted_path` recovers it) render the same way. Pictures use matplotlib, imported only when a
picture is drawn: a maintained library that writes SVG and PNG from pip wheels alone (graphviz
would need its `dot` program installed beside it).

    python -m sglang_ddtree.tree.show DUMP.jsonl --out DIR [--tokenizer DIR] [--format svg|png]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Decode = Callable[[int], str]


def from_round(tree, accept, b: int = 0) -> dict:
    """The record of request b of a round (`DraftTree`, `AcceptResult`; host tensors)."""
    num_accepted = int(accept.num_accepted[b])
    return {
        "tokens": [int(t) for t in tree.tokens[b]],
        "parents": [int(p) for p in tree.parents[b]],
        "q": [math.exp(float(s)) for s in tree.scores[b]],
        "accepted": [int(i) for i in accept.path[b, : num_accepted + 1]],
        "bonus": int(accept.bonus[b]),
        "width": int(tree.tokens.shape[1]),
    }


def accepted_path(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list:
    """Node indices root-first that the emitted tokens (accepted drafts, then the bonus) took
    down the tree: at each depth the child carrying the next emitted token."""
    path = [0]
    for token in emitted[:-1]:
        child = next(
            (i for i, p in enumerate(parents) if p == path[-1] and tokens[i] == token), None
        )
        if child is None:
            raise ValueError(f"emitted token {token} is no child of node {path[-1]}")
        path.append(child)
    return path


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents):
        if i and p >= 0:
            kids[p].append(i)
    return kids


ROOT_NOTE = "root: the last committed token, not drafted"


def format_q(q: float, digits: int = 3) -> str:
    """A path probability to `digits` significant digits, in scientific notation below 1e-4
    (0.439, 0.0045, 3.1e-07): a small q stays legible instead of rounding to 0.00."""
    return f"{q:.{digits}g}"


def render_text(record: dict, decode: Decode = str, max_nodes: int = 64) -> str:
    """An indented outline of the tree, best-first among siblings: `*` marks the accepted path,
    the bonus token follows the deepest accepted node, the root (the last committed token, which
    the tree grows from) is labelled so. At most max_nodes lines of nodes."""
    tokens, q, on_path = record["tokens"], record["q"], set(record["accepted"])
    kids, lines = children(record["parents"]), []
    n_acc = len(record["accepted"]) - 1
    head = f"{record['width']} nodes, {n_acc} accepted + bonus {decode(record['bonus'])!r}"

    def walk(node: int, depth: int) -> None:
        if len(lines) >= max_nodes:
            return
        mark = "*" if node in on_path else " "
        label = ROOT_NOTE if node == 0 else f"q={format_q(q[node])}"
        lines.append(f"{mark} {'  ' * depth}{decode(tokens[node])!r} ({label})")
        if node == record["accepted"][-1]:
            lines.append(f"+ {'  ' * (depth + 1)}{decode(record['bonus'])!r} (bonus)")
        for child in kids[node]:
            walk(child, depth + 1)

    walk(0, 0)
    more = record["width"] - sum(1 for line in lines if not line.startswith("+"))
    return "\n".join([head, *lines, *([f"  ... {more} more nodes"] if more > 0 else [])])


def layout(parents: Sequence[int]) -> dict[int, tuple[float, float]]:
    """(x = depth, y = row) per node: leaves on consecutive rows in depth-first order, each
    inner node centred on its children."""
    kids, pos, next_row = children(parents), {}, [0.0]

    def place(node: int, depth: int) -> float:
        if not kids[node]:
            y = next_row[0]
            next_row[0] += 1.0
        else:
            ys = [place(c, depth + 1) for c in kids[node]]
            y = (ys[0] + ys[-1]) / 2
        pos[node] = (float(depth), y)
        return y

    place(0, 0)
    return pos


ACCEPTED, DRAFTED, BONUS = "#e8590c", "#adb5bd", "#2f9e44"  # edge colours
ROOT_FACE, ROOT_EDGE = "#d0ebff", "#1971c2"
LEGEND = (
    "root: the last committed token (not drafted); the tree grows from it",
    "accepted path (drafted tokens the target confirmed)",
    "drafted, not accepted",
    "bonus: the target's own token after the accepted path",
    "number under a token: q, the drafter's probability of the root-to-token path",
)


def picture_positions(record: dict) -> dict[int, tuple[float, float]]:
    """`layout` of the tree with the bonus token as one more node (index = width), the last
    child of the deepest accepted node: it gets a row of its own, so it never covers a drafted
    sibling (a bonus token is never among that node's children: the walk would have accepted
    the child carrying it)."""
    return layout([*record["parents"], record["accepted"][-1]])


def _draw_edges(ax, record: dict, pos: dict) -> None:
    on_path, bonus = set(record["accepted"]), len(record["parents"])
    for node, parent in enumerate(record["parents"]):
        if node and parent >= 0:
            hot = node in on_path
            (x0, y0), (x1, y1) = pos[parent], pos[node]
            ax.plot(
                [x0, x1],
                [y0, y1],
                color=ACCEPTED if hot else DRAFTED,
                lw=2.2 if hot else 0.8,
                zorder=1,
            )
    (x0, y0), (x1, y1) = pos[record["accepted"][-1]], pos[bonus]
    ax.plot([x0, x1], [y0, y1], color=BONUS, lw=2.2, ls="--", zorder=1)


def _draw_nodes(ax, record: dict, pos: dict, decode: Decode) -> None:
    on_path = set(record["accepted"])
    for node in range(len(record["parents"])):
        text = decode(record["tokens"][node])
        if node == 0:
            label, face, edge = f"{text!r}\nroot", ROOT_FACE, ROOT_EDGE
        else:
            label = f"{text!r}\n{format_q(record['q'][node], 2)}"
            face, edge = ("#ffd8a8" if node in on_path else "#f1f3f5"), "#495057"
        ax.text(
            *pos[node],
            label,
            ha="center",
            va="center",
            fontsize=7,
            zorder=2,
            bbox=dict(boxstyle="round,pad=0.25", fc=face, ec=edge, lw=0.6),
        )
    ax.text(
        *pos[len(record["parents"])],
        f"{decode(record['bonus'])!r}\nbonus",
        ha="center",
        va="center",
        fontsize=7,
        zorder=2,
        bbox=dict(boxstyle="round,pad=0.25", fc="#b2f2bb", ec=BONUS, lw=0.8),
    )


def _draw_legend(ax) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], ls="none", marker="s", ms=8, mfc=ROOT_FACE, mec=ROOT_EDGE),
        Line2D([], [], color=ACCEPTED, lw=2.2),
        Line2D([], [], color=DRAFTED, lw=0.8),
        Line2D([], [], color=BONUS, lw=2.2, ls="--"),
        Line2D([], [], ls="none"),
    ]
    ax.legend(
        handles,
        LEGEND,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=2,
        fontsize=7,
        frameon=False,
        handlelength=2.5,
    )


def draw_round(record: dict, decode: Decode = str, title: str = ""):
    """The round as a matplotlib figure: nodes by depth with their token and q, edges to the
    parent, the root (the last committed token) in blue, the accepted path in orange, the bonus
    token in green after it, a legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = picture_positions(record)
    rows = max(y for _, y in pos.values()) + 1
    depth = max(x for x, _ in pos.values()) + 1
    fig, ax = plt.subplots(figsize=(2.0 + 1.9 * depth, 1.6 + 0.32 * rows))
    _draw_edges(ax, record, pos)
    _draw_nodes(ax, record, pos, decode)
    _draw_legend(ax)
    ax.set_xlim(-0.6, depth - 0.4)
    ax.set_ylim(rows - 0.5, -0.8)
    ax.axis("off")
    n_acc = len(record["accepted"]) - 1
    ax.set_title(title or f"{record['width']} nodes, {n_acc} accepted + bonus", fontsize=9)
    fig.tight_layout()
    return fig


def render_picture(record: dict, path: str | Path, decode: Decode = str, title: str = "") -> Path:
    """Draw the round (`draw_round`) to `path` (.svg or .png)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    # the same round draws the same bytes: no date in the file, SVG ids from a fixed salt
    with plt.rc_context({"svg.hashsalt": "ddtree"}):
        fig = draw_round(record, decode, title)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path


def token_decoder(tokenizer) -> Decode:
    """Token id -> its text (special tokens shown as themselves); plain ids without one."""
    if tokenizer is None:
        return str
    return lambda t: tokenizer.decode([t], skip_special_tokens=False)


def read_dump(path: str | Path) -> list[dict]:
    """A server dump's rounds (round/round_dump.py) as round records."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            row.setdefault("accepted", accepted_path(row["tokens"], row["parents"], row["emitted"]))
            row.setdefault("bonus", row["emitted"][-1])
            records.append(row)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_ddtree.tree.show",
        description="render a server's dumped DDTree rounds",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("dump", help="JSON lines written with SGLANG_DDTREE_DUMP_ROUNDS")
    p.add_argument("--out", required=True, help="folder for the pictures")
    p.add_argument("--tokenizer", help="tokenizer folder to print tokens as text")
    p.add_argument("--format", choices=["svg", "png"], default="svg")
    args = p.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    decode = token_decoder(tokenizer)
    for i, record in enumerate(read_dump(args.dump)):
        where = f"round {record.get('round', i)}, request {record.get('request', 0)}"
        print(f"== {where}\n{render_text(record, decode)}")
        name = f"round_{record.get('round', i):06d}_req{record.get('request', 0)}.{args.format}"
        render_picture(record, Path(args.out) / name, decode, title=where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
