"""Budget by load in the server: the verify widths, the per-round policy
(round/widths.WidthPolicy), its lagged readings (round/widths.RoundReadings) and the two
switches (SGLANG_DDTREE_WIDTH / _WIDTHS). The server side runs in tests/gpu."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.accept.budget import expected_tokens
from sglang_ddtree.config import Options, automatic_widths, verify_widths
from sglang_ddtree.round.widths import WidthPolicy

WIDTHS = (16, 32, 64)


def test_verify_widths_double_from_the_block_to_n_and_take_a_list():
    assert verify_widths(16, 32) == (16, 32)
    assert verify_widths(16, 64) == (16, 32, 64)
    assert verify_widths(16, 48) == (16, 32, 48)
    assert verify_widths(5, 31) == (5, 10, 20, 31)
    assert verify_widths(16, 16) == (16,)  # one width: the server runs it fixed
    assert verify_widths(16, 64, (24, 16)) == (16, 24, 64)  # N is always one
    with pytest.raises(ValueError, match=r"\[B, N\] = \[16, 64\].*\[8, 80\]"):
        verify_widths(16, 64, (8, 32, 80))
    # the widths a server chooses among: none when fixed or when N is the only one
    assert automatic_widths("auto", 16, 64) == (16, 32, 64)
    assert automatic_widths("fixed", 16, 64) == () == automatic_widths("auto", 16, 16)
    assert automatic_widths("auto", 16, 64, (64,)) == ()
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        automatic_widths("fixed", 16, 64, (8,))  # checked whichever the mode


def _calibrated(policy: WidthPolicy, bs: int, ms: dict[int, float], predicted, accepted):
    """Run the calibration rounds of one batch bucket with these costs and readings."""
    for _ in range(policy.explore * len(policy.widths)):
        width = policy.choose(bs)
        policy.observe_cost(bs, width, ms[width])
        policy.observe_tokens(width, predicted, accepted[width])


def test_the_calibration_runs_the_narrowest_first_and_widens_while_the_widest_pays():
    policy = WidthPolicy(WIDTHS, buckets=(1, 2, 4, 8, 16), explore=2)
    policy.observe_tokens(16, [2.4, 2.7, 3.0], 2.4)
    seen = []
    for _ in range(6):
        width = policy.choose(1)
        seen.append(width)
        policy.observe_cost(1, width, 20.0)
    assert seen == [16, 16, 32, 32, 64, 64]
    # a flat cost: the widest tree, which predicts the most tokens
    policy.observe_tokens(64, [2.4, 2.7, 3.0], 3.0)
    assert policy.choose(1) == 64


def test_the_policy_takes_the_narrowest_width_when_cost_grows_steeply_with_width():
    """The chain's case: at a compute-bound batch, wider trees cost more than they add."""
    policy = WidthPolicy(WIDTHS, buckets=(1, 16))
    acc = {16: 2.3, 32: 2.5, 64: 2.6}
    _calibrated(policy, 16, {16: 40.0, 32: 60.0, 64: 100.0}, [2.4, 2.7, 2.9], acc)
    assert policy.choose(16) == 16
    # the same readings, a flat cost at batch 1: wide
    _calibrated(policy, 1, {16: 20.0, 32: 20.5, 64: 21.0}, [2.4, 2.7, 2.9], acc)
    assert policy.choose(1) == 64
    # batches pad to their bucket: 9..16 share batch 16's costs
    assert policy.bucket(9) == 16 and policy.choose(9) == 16
    assert policy.bucket(40) == 64  # beyond the graphs: the power of two, calibrated anew
    assert policy.choose(40) == 16  # (the calibration's first width)
    assert WidthPolicy(WIDTHS).bucket(5) == 8  # no graphs at all: powers of two


def test_the_observed_ratio_per_width_corrects_the_drafters_optimism():
    """The drafter predicts 3.5 tokens at 64 but the target accepts 2.85 there: at 10% more cost
    than 32 (which accepts 2.8 of its predicted 2.9) the narrower width wins; on the drafter's
    own numbers 64 would."""
    policy = WidthPolicy(WIDTHS, buckets=(8,), decay=0.5)
    accepted = {16: 2.4, 32: 2.8, 64: 2.85}
    _calibrated(policy, 8, {16: 30.0, 32: 30.0, 64: 33.0}, [2.4, 2.9, 3.5], accepted)
    for _ in range(20):  # the running ratios settle
        for width in WIDTHS:
            policy.observe_tokens(width, [2.4, 2.9, 3.5], accepted[width])
    assert policy.tokens(64) == pytest.approx(2.85, rel=1e-3)
    assert policy.tokens(32) == pytest.approx(2.8, rel=1e-3)
    assert 3.5 / 33.0 > 2.9 / 30.0  # uncorrected, 64 would win
    assert policy.choose(8) == 32


def test_a_wider_width_never_reads_fewer_tokens_or_a_lower_cost_than_a_narrower_one():
    """Ratios learned on different rounds can say that 32 nodes accept fewer tokens than 16
    (1.55 against 1.63 in one measured table), and a host-bound server's noise that 32 costs
    less: the wider width reads the narrower one's tokens, the two costs their mean. Flat
    costs measured the wrong way round then leave the choice to the tokens, and the wider
    width wins."""
    policy = WidthPolicy((16, 32), buckets=(4,), decay=0.5)
    _calibrated(policy, 4, {16: 6.0, 32: 4.2}, [1.7, 1.8], {16: 1.63, 32: 1.55})
    assert policy.tokens(32) == policy.tokens(16) == pytest.approx(1.63, rel=1e-3)
    assert "(as calibrated: 16: 1.63 32: 1.55)" in policy.table()  # the raw ratios stay visible
    assert policy.costs(4) == {16: pytest.approx(5.1), 32: pytest.approx(5.1)}
    assert policy.choose(4) == 32
    # measured the right way round, costs are kept as they are, and a steep one decides: 32
    # loses to 16, so 64 is never run at this batch
    policy = WidthPolicy((16, 32, 64), buckets=(4,))
    _calibrated(policy, 4, {16: 5.0, 32: 9.0, 64: 8.0}, [2.0, 2.1, 2.2], {16: 2, 32: 2.1, 64: 2.2})
    assert policy.costs(4) == {16: 5.0, 32: 9.0} and policy.samples[4, 64] == 0
    assert policy.choose(4) == 16
    # 32 pays, so 64 is run, and the two measured the wrong way round are pooled
    policy = WidthPolicy((16, 32, 64), buckets=(4,))
    _calibrated(policy, 4, {16: 5.0, 32: 5.4, 64: 5.2}, [2.0, 2.2, 2.3], {16: 2, 32: 2.2, 64: 2.3})
    assert policy.costs(4) == {16: 5.0, 32: pytest.approx(5.3), 64: pytest.approx(5.3)}
    assert policy.choose(4) == 64


def test_a_close_width_is_measured_again_every_refresh_rounds_a_far_slower_one_rarely():
    """After the calibration a width the policy is not choosing runs again, for window // 2 + 1
    = 3 rounds in a row (enough to move a median of 5), once refresh x max(1, shortfall /
    tolerance) of the bucket's rounds have passed since it last ran: 16 is 1% slower than 32
    (every 10 rounds), 64 two thirds slower (every 10 x 0.663 / 0.02 = 332 rounds)."""
    ms = {16: 10.0, 32: 10.0, 64: 30.0}
    tokens = {16: 2.0, 32: 2.02, 64: 2.04}
    policy = WidthPolicy(WIDTHS, buckets=(1,), refresh=10, explore=2)
    _calibrated(policy, 1, ms, list(tokens.values()), tokens)  # rounds 1-6: 16, 32, 64
    picks = {}
    for i in range(7, 407):  # the bucket's rounds
        width = policy.choose(1)
        picks.setdefault(width, []).append(i)
        policy.observe_cost(1, width, ms[width])
        policy.observe_tokens(width, list(tokens.values()), tokens[width])
    # 16 last ran at round 2: due at 12, then 10 rounds after each burst's last round
    assert picks[16][:9] == [12, 13, 14, 24, 25, 26, 36, 37, 38], picks[16][:9]
    # last ran at 6: due after 331.7 rounds, at 338, which 16's burst of 336-338 holds
    assert picks[64] == [339, 340, 341]
    with pytest.raises(ValueError, match="tolerance"):
        WidthPolicy(WIDTHS, tolerance=0.0)


def test_the_automatic_width_is_within_half_a_percent_of_the_best_fixed_one_at_27b():
    """On the cost table a 27B-shaped server measured (SGLang 0.5.23, its log's ms per round
    at widths 16 and 32 by batch bucket) and its tokens per round (3.80 at 16, 4.32 at 32),
    4,000 rounds per bucket, calibration included: the policy's tokens per ms against the best
    fixed width's. Refreshing every 32 rounds whatever the shortfall cost 0.9 / 1.7 / 4.3 /
    5.0% at batch 1 / 8 / 16 / 32."""
    table = {
        1: {16: 21.91, 32: 22.43},
        8: {16: 26.59, 32: 35.09},
        16: {16: 38.00, 32: 61.82},
        32: {16: 67.15, 32: 114.66},
    }
    tokens = {16: 3.80, 32: 4.32}
    graph_buckets = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32)
    for bs, ms in table.items():
        policy = WidthPolicy((16, 32), buckets=graph_buckets)
        got = spent = 0.0
        for _ in range(4000):
            width = policy.choose(bs)
            policy.observe_cost(bs, width, ms[width])
            policy.observe_tokens(width, [tokens[16], tokens[32]], tokens[width])
            got, spent = got + tokens[width], spent + ms[width]
        best = max(tokens[w] / ms[w] for w in (16, 32))
        assert got / spent >= 0.995 * best, (bs, got / spent / best, policy.chosen)


def test_widths_16_to_256_are_run_only_where_the_measured_table_says_they_pay():
    """N = 256 gives widths 16 to 256. Tokens per round: the fitted ddtree_paper world's
    (docs/data/world_fit.jsonl: 8.10, 9.12, 9.66, 10.07, 10.39); ms per round: the 27B table
    above at 16 and 32, wider widths extended in proportion to the verified tokens (the GDN
    verify is the chunked kernel at every width to 256). At batch 1 the policy widens to 128,
    finds it slower than 64, and stops: 256 never runs; at batch 32, where 32 already loses to
    16, nothing above 32 runs."""
    assert verify_widths(16, 256) == (16, 32, 64, 128, 256)
    tokens = {16: 8.10, 32: 9.12, 64: 9.66, 128: 10.07, 256: 10.39}
    table = {
        1: {16: 21.91, 32: 22.43, 64: 23.47, 128: 25.55, 256: 29.71},
        32: {16: 67.15, 32: 114.66, 64: 209.7, 128: 399.7, 256: 779.8},
    }
    for bs, ms in table.items():
        policy = WidthPolicy(tuple(tokens), buckets=(1, 2, 4, 8, 16, 24, 32))
        got = spent = 0.0
        for _ in range(4000):
            width = policy.choose(bs)
            policy.observe_cost(bs, width, ms[width])
            policy.observe_tokens(width, list(tokens.values()), tokens[width])
            got, spent = got + tokens[width], spent + ms[width]
        best = max(tokens, key=lambda w: tokens[w] / ms[w])
        assert got / spent >= 0.99 * tokens[best] / ms[best], (bs, policy.chosen)
        assert max(policy.chosen, key=policy.chosen.get) == best
        never = {1: (256,), 32: (64, 128, 256)}[bs]
        assert all(policy.samples[bs, w] == 0 for w in never), (bs, policy.chosen)
        assert policy.known(bs) == tuple(w for w in tokens if w not in never)


def test_the_table_names_every_width_and_what_was_chosen():
    policy = WidthPolicy(WIDTHS, buckets=(1, 8), explore=2)
    assert "none yet" in policy.table()
    _calibrated(policy, 1, {16: 20.0, 32: 21.0, 64: 22.0}, [2.0, 2.5, 3.0], {16: 2, 32: 2.5, 64: 3})
    lines = policy.table().splitlines()
    assert lines[0].split()[1:] == ["16", "32", "64"]
    assert lines[1].split() == ["1", "20.00", "21.00", "22.00"]
    assert lines[-1] == "widths chosen: 16 x 2, 32 x 2, 64 x 2"
    policy.eager[16] += 3
    assert policy.table().splitlines()[-1] == "verified without CUDA graphs: 16 x 3"
    with pytest.raises(ValueError, match="increasing"):
        WidthPolicy((32, 16))
    with pytest.raises(ValueError, match="explore, refresh and window"):
        WidthPolicy((16, 32), explore=0)
    with pytest.raises(ValueError, match="3 predictions"):
        policy.observe_tokens(16, [1.0], 1.0)


def test_expected_tokens_at_widths_read_no_device_value():
    scores = torch.log(torch.tensor([[1.0, 0.5, 0.25, 0.25], [1.0, 0.9, 0.8, 0.1]]))
    got = expected_tokens(scores, (2, 4))
    assert torch.allclose(got, torch.tensor([[1.5, 2.0], [1.9, 2.8]]))
    with pytest.raises(ValueError, match="must be in"):
        expected_tokens(scores, (5,))


class _Head:
    """The draft head's readings buffer (round/draft_head.DraftTreeHead.read_widths and
    the lines of its build that fill it), without a model."""

    def __init__(self, max_bs: int, num_nodes: int = 64):
        from sglang_ddtree.round.draft_head import DraftTreeHead

        self.scores = torch.zeros((max_bs, num_nodes))
        self.max_bs, self.readings = max_bs, None
        self.read_widths = DraftTreeHead.read_widths.__get__(self)
        self.build = DraftTreeHead.write_readings.__get__(self)  # what a build ends with


def test_the_draft_head_computes_the_expected_tokens_in_its_build():
    """The readings' expected tokens come from the draft head's build (inside the draft's CUDA
    graph): the same numbers as expected_tokens of the built tree's scores, and the column for
    the accepted lengths left to the readings."""
    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round.draft_head import DraftTreeHead

    torch.manual_seed(0)
    cfg = DDTreeConfig(block_size=4, num_nodes=8, topk=2)
    weight = torch.randn(50, 16)
    head = DraftTreeHead(lm_head_weight=weight, vocab_size=50, cfg=cfg, max_bs=3)
    hidden, ids = torch.randn(2 * 4, 16), torch.randint(0, 50, (2 * 4,))
    head(hidden, ids)
    assert head.readings is None  # fixed widths: nothing computed
    with pytest.raises(ValueError, match="must be in"):
        head.read_widths((4, 9))
    head.read_widths((4, 8))
    assert head.readings.shape == (3, 4)  # expected | accepted, per width
    head.readings.fill_(-1.0)
    head(hidden, ids)
    want = expected_tokens(head.tree(2).scores, (4, 8))
    assert torch.equal(head.readings[:2, :2], want)
    assert (head.readings[:2, 2:] == -1).all() and (head.readings[2] == -1).all()


def test_the_draft_head_cuts_the_trees_at_the_read_widths_as_truncate_does():
    """head.tree(bs, w) at a read width: the links cut in the build; at any other width: cut
    then. Both are truncate(head.tree(bs), w), field by field (links past the cut are -1)."""
    from sglang_ddtree.accept.budget import truncate
    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round.draft_head import DraftTreeHead

    torch.manual_seed(1)
    cfg = DDTreeConfig(block_size=4, num_nodes=12, topk=3)
    head = DraftTreeHead(lm_head_weight=torch.randn(40, 8), vocab_size=40, cfg=cfg, max_bs=4)
    head.read_widths((3, 6, 12))
    assert sorted(head.cuts) == [3, 6]
    for bs in (3, 2):  # a smaller batch after a larger one: the buffers' first rows only
        head(torch.randn(bs * 4, 8), torch.randint(0, 40, (bs * 4,)))
        for w in (3, 5, 6, 12):
            got, want = head.tree(bs, w), truncate(head.tree(bs), w)
            for name, value in want._asdict().items():
                assert torch.equal(getattr(got, name), value), (bs, w, name)
            assert got.tokens.shape == (bs, w)
        assert (head.tree(bs).first_child[:, :3] >= 3).any()  # links the cut takes away
    assert all(torch.equal(a, b) for a, b in zip(head.tree(2), head.tree(2, 12), strict=True))


class FakeEvent:
    """A CUDA event stand-in: completes when the test says so; 'times' in ms."""

    clock = 0.0

    def __init__(self):
        self.done, self.at = False, None

    def record(self):
        FakeEvent.clock += 1.0
        self.done, self.at = False, FakeEvent.clock

    def query(self):
        return self.done

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time on an event that has not completed"
        return 10.0 * (end.at - self.at)


def test_readings_reach_the_policy_only_when_their_round_has_completed():
    from sglang_ddtree.round.widths import RoundReadings

    policy = WidthPolicy(WIDTHS, buckets=(4,))
    head = _Head(max_bs=4)
    head.read_widths(WIDTHS)
    readings = RoundReadings(policy, head.readings, head.reading_widths, slots=2, event=FakeEvent)
    scores = torch.log(torch.tensor([[1.0] + [0.5] * 63] * 3))  # 3 requests, q = 0.5 each
    head.build(scores)  # what the draft head writes inside the draft graph
    readings.start(3, 32)
    # accepted per request at 16, 32, 64 (the last wider than the round: its own)
    readings.finish(torch.tensor([[2.0, 3, 3], [4, 4, 4], [3, 5, 5]]))
    assert readings.poll() == 0 and policy.predicted is None  # the round is still out
    first = readings.slots[0]
    first.start.done = first.end.done = True
    assert readings.poll() == 1
    assert policy.predicted == pytest.approx([8.5, 16.5, 32.5])  # 1 + 0.5 x (w - 1)
    # the ratios, from this first reading: 4 per request of 16.5 predicted at 32, and the
    # narrower width read on the same round, 3 of 8.5; 64 not read: every round's ratio (32's)
    assert policy.ratio[32].ratio == pytest.approx(4 / 16.5)
    assert policy.ratio[16].ratio == pytest.approx(3 / 8.5)
    assert policy.ratio[64].ratio is None
    assert policy.tokens(64) == pytest.approx(32.5 * 4 / 16.5)
    assert policy.cost[4, 32] == pytest.approx(10.0)  # start -> end: one tick apart
    assert readings.poll() == 0  # read once
    # both slots out: the third round is not measured (no wait, no overwrite)
    ones = torch.ones(3, 3)
    readings.start(3, 32)
    readings.finish(ones)
    readings.start(3, 32)
    readings.finish(ones)
    readings.start(3, 16)
    assert readings.current is None
    readings.finish(ones)  # dropped
    assert sum(slot.pending for slot in readings.slots) == 2


def test_readings_serve_a_policy_whose_widths_lost_one_to_memory():
    """A width whose graphs did not fit is dropped from the policy, not from the draft graph's
    readings (captured before): the policy reads its own widths' columns."""
    from sglang_ddtree.round.widths import RoundReadings

    head = _Head(max_bs=2)
    head.read_widths(WIDTHS)
    policy = WidthPolicy((16, 64), buckets=(2,))
    readings = RoundReadings(policy, head.readings, head.reading_widths, event=FakeEvent)
    head.build(torch.log(torch.tensor([[1.0] + [0.5] * 63] * 2)))
    readings.start(2, 64)
    readings.finish(torch.tensor([[2.0, 9, 4], [2, 9, 4]]))  # 32's column: not the policy's
    readings.slots[0].start.done = readings.slots[0].end.done = True
    assert readings.poll() == 1
    assert policy.predicted == pytest.approx([8.5, 32.5])
    assert policy.ratio[16].ratio == pytest.approx(2 / 8.5)
    assert policy.ratio[64].ratio == pytest.approx(4 / 32.5)
    with pytest.raises(ValueError, match="cannot serve"):
        RoundReadings(WidthPolicy((16, 48)), head.readings, WIDTHS)


@pytest.mark.parametrize(
    "env,deterministic,width,widths",
    [
        ({}, False, "auto", None),
        ({}, True, "fixed", None),  # batch-invariant tokens need one width
        ({"SGLANG_DDTREE_WIDTH": "auto"}, True, "auto", None),
        ({"SGLANG_DDTREE_WIDTH": "fixed"}, False, "fixed", None),
        ({"SGLANG_DDTREE_WIDTHS": "64, 16,32"}, False, "auto", (16, 32, 64)),
    ],
)
def test_the_width_switches(monkeypatch, env, deterministic, width, widths):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    opts = Options.from_env(deterministic=deterministic)
    assert (opts.width, opts.widths) == (width, widths)


def test_tensor_parallel_runs_one_width_unless_asked_for_the_shared_automatic_one(monkeypatch):
    """At --tp-size > 1 the widths are fixed by default (until a multi-GPU run has checked the
    shared choice); SGLANG_DDTREE_WIDTH=auto is served there by rank 0's choice, broadcast."""
    from sglang_ddtree.adapter import compat

    modes = compat.option_modes(SimpleNamespace(tp_size=2))
    assert modes["tensor_parallel"]
    assert not compat.option_modes(SimpleNamespace())["tensor_parallel"]  # tp 1 when unset
    assert Options.from_env(**modes).width == "fixed"
    monkeypatch.setenv("SGLANG_DDTREE_WIDTH", "auto")
    assert Options.from_env(**modes).width == "auto"
    monkeypatch.delenv("SGLANG_DDTREE_WIDTH")
    assert Options.from_env().width == "auto"  # one GPU: the default


def _rank_widths_process(rank: int, port: int, out: str) -> None:
    """One of two TP ranks on the CPU (gloo): RankWidths over the default group, as a worker
    would run it over SGLang's TP CPU group; its results to out.RANK."""
    import json

    import torch.distributed as dist

    from sglang_ddtree.round.widths import RankWidths

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ranks = RankWidths(None, 0, rank == 0)
        # rank 1 captured no 32 (a capture that failed there); rank 0 captured all
        kept = ranks.agree((16, 32, 64), (16, 32, 64) if rank == 0 else (16, 64))
        chosen = [64, 16, 16, 64, 16]  # rank 0's policy, round by round
        got = [ranks.share(w if rank == 0 else None) for w in chosen]
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"kept": kept, "got": got}, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_rank_0s_width_among_the_widths_all_captured(tmp_path):
    """RankWidths in two real processes over gloo: both keep the widths every rank captured
    (rank 1 lacks 32), and in every round verify the width rank 0's policy chose. A collective
    one rank skips would hang them: the test fails after 120 s instead of waiting."""
    import json
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ranks")
    ranks = mp.start_processes(
        _rank_widths_process, args=(port, out), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ranks.processes:
                proc.kill()
            pytest.fail("the two ranks did not finish in 120 s (a collective left unmatched)")
    results = [json.loads(open(f"{out}.{r}").read()) for r in (0, 1)]
    assert [r["kept"] for r in results] == [[16, 64], [16, 64]]
    assert [r["got"] for r in results] == [[64, 16, 16, 64, 16]] * 2


@pytest.mark.parametrize("kept", [(16, 64), (64,)])
def test_the_worker_at_tensor_parallel_takes_rank_0s_width(monkeypatch, kept):
    """A TP worker with auto widths serves what every rank captured (RankWidths.agree: here
    rank 0 lacks 32, or every width but N is missing somewhere, which leaves N fixed, with no
    policy and nothing shared); rank 0 runs the policy and shares its choice, another rank
    builds no policy and verifies what it is sent. Its captures are decided by the least free
    memory of all ranks (compat.least_free_gb)."""
    from sglang_ddtree import config
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.round import widths

    shared, asked = [], []

    class Sent:
        def __init__(self, group, source, is_source):
            self.is_source = is_source

        def agree(self, configured, captured):
            assert configured == captured == (16, 32, 64)  # without graphs: all of them
            return kept

        def share(self, width):
            if self.is_source:
                shared.append(width)
                return width
            return 64

    built = []

    def verify_widths(model_runner, ws, capture, free_gb=None):
        built.append(free_gb)
        return widths.VerifyWidths(model_runner, ws, capture)

    for is_source in (True, False):
        shared.clear()
        worker_mod, w = _worker(N=64)
        w._tp_size = 2
        w.runtime = SimpleNamespace(options=config.Options.from_env())  # the factory's
        monkeypatch.setattr(
            worker_mod,
            "RoundReadings",
            lambda policy, buffer, widths: RoundReadingsOnCpu(policy, buffer, widths),
        )
        monkeypatch.setattr(worker_mod, "RankWidths", Sent)
        monkeypatch.setattr(worker_mod, "VerifyWidths", verify_widths)
        monkeypatch.setattr(compat, "tp_cpu_group", lambda s=is_source: (None, 0, s))
        monkeypatch.setattr(compat, "least_free_gb", lambda *a: asked.append(a) or 100.0)
        w.gpu_id = 3
        w._ask_for_readings()
        w._init_widths(capture=False)
        assert built[-1]() == 100.0 and asked[-1] == ("cpu", 3)  # every rank's least free GB
        width = w._choose_width(3)
        if kept == (64,):  # one width left: fixed at N on every rank, no collective a round
            assert w._widths is None and w._rank_widths is None and w._readings is None
            assert width == 64 and shared == []
        elif is_source:
            assert w._widths.widths == (16, 64) and set(w._widths.states) == {16, 64}
            assert w._readings.policy.widths == (16, 64)
            assert shared == [16] and width == 16  # the policy calibrates the narrowest first
        else:
            assert w._widths.widths == (16, 64) and w._readings is None
            assert width == 64 and w.speculative_num_draft_tokens == 64


@pytest.mark.parametrize(
    "env,message",
    [
        ({"SGLANG_DDTREE_WIDTH": "adaptive"}, "SGLANG_DDTREE_WIDTH must be 'auto' or 'fixed'"),
        ({"SGLANG_DDTREE_WIDTHS": "16,x"}, "SGLANG_DDTREE_WIDTHS must be comma-separated"),
        ({"SGLANG_DDTREE_WIDTHS": "0"}, "SGLANG_DDTREE_WIDTHS must be comma-separated"),
        (
            {"SGLANG_DDTREE_WIDTH": "fixed", "SGLANG_DDTREE_WIDTHS": "16"},
            "set SGLANG_DDTREE_WIDTH=auto",
        ),
    ],
)
def test_bad_width_switches_name_the_switch_and_the_fix(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        Options.from_env()


def test_a_bucket_is_reported_once_when_its_calibration_completes():
    policy = WidthPolicy(WIDTHS, buckets=(1, 8), explore=2)
    for _ in range(5):
        policy.observe_cost(1, policy.choose(1), 20.0)
        assert policy.newly_calibrated() == []
    policy.observe_cost(1, policy.choose(1), 20.0)
    assert policy.newly_calibrated() == [1]
    policy.observe_cost(1, policy.choose(1), 20.0)
    assert policy.newly_calibrated() == []


def test_calibration_completes_when_readings_come_rounds_late():
    """The server's readings arrive a round or more after the round ran, so the calibration
    over-runs a width before its samples show; the bucket is still announced, once."""
    policy = WidthPolicy(WIDTHS, buckets=(1,))
    lag, announced = [], []
    for _ in range(40):
        width = policy.choose(1)
        lag.append(width)
        if len(lag) > 2:  # two rounds late
            policy.observe_cost(1, lag.pop(0), 20.0)
        announced += policy.newly_calibrated()
    assert announced == [1]
    assert all(policy.samples[1, w] >= policy.explore for w in WIDTHS)


def test_one_stalled_round_does_not_move_the_cost_a_width_is_chosen_by():
    """The events time the host's stalls too: on the GPU suite's host-bound servers a single
    round read 10x its width's cost and a mean-based policy then chose the
    narrow width for most rounds. The median of the recent rounds shrugs one off."""
    policy = WidthPolicy(WIDTHS, buckets=(8,))
    costs = {16: 8.0, 32: 8.1, 64: 8.2}  # host-bound: every width costs about the same
    stalled = False
    for _ in range(policy.explore * len(WIDTHS)):
        width = policy.choose(8)
        ms = costs[width]
        if width == 64 and not stalled:
            ms, stalled = 90.0, True
        policy.observe_cost(8, width, ms)
        policy.observe_tokens(width, [1.9, 2.2, 2.4], {16: 1.9, 32: 2.2, 64: 2.4}[width])
    assert policy.cost[8, 64] == pytest.approx(8.2)
    assert policy.choose(8) == 64


def _worker(N: int = 32, B: int = 16):
    """A DDTreeWorker with only what _init_widths reads (no model, no GPU)."""
    worker_mod = pytest.importorskip("sglang_ddtree.round.worker")
    from sglang_ddtree.config import DDTreeConfig

    w = worker_mod.DDTreeWorker.__new__(worker_mod.DDTreeWorker)
    w.cfg = DDTreeConfig(block_size=B, num_nodes=N, topk=8)
    w._tp_rank = 0
    w.tree_head = _Head(max_bs=4, num_nodes=N)
    w._target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(attn_backend="backend N", decode_cuda_graph_runner=None)
    )
    w.device = "cpu"
    w._widths = w._readings = w._rank_widths = None
    w._tp_size = 1
    return worker_mod, w


@pytest.mark.parametrize("env", [{"SGLANG_DDTREE_WIDTH": "fixed"}, {"SGLANG_DDTREE_WIDTHS": "32"}])
def test_the_worker_serves_one_width_when_fixed_or_given_only_n(monkeypatch, env):
    """A fixed-width server must not build its policy for widths that are never captured: that
    made every fixed-width server fail at start-up."""
    from sglang_ddtree import config

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    worker_mod, w = _worker()
    w.runtime = SimpleNamespace(options=config.Options.from_env())  # the factory's
    w._ask_for_readings()
    assert w.tree_head.readings is None  # one width: nothing for the draft graph to compute
    w._init_widths(capture=True)
    assert w._widths is None and w._readings is None
    assert w._choose_width(3) == 32


def test_the_worker_chooses_among_the_widths_without_graphs(monkeypatch):
    """auto without decode CUDA graphs: every width verifies through the one backend, and the
    policy's first choice is the narrowest (its calibration); /server_info's report counts the
    rounds per width."""
    from sglang_ddtree import config
    from sglang_ddtree.round.runtime import Runtime

    worker_mod, w = _worker(N=64)
    w.runtime = Runtime.create(config.Options.from_env(), w.cfg)  # the factory's
    assert "widths_chosen" not in w.runtime.report()
    monkeypatch.setattr(
        worker_mod,
        "RoundReadings",
        lambda policy, buffer, widths: RoundReadingsOnCpu(policy, buffer, widths),
    )
    with pytest.raises(RuntimeError, match="not asked for before the draft graphs"):
        w._init_widths(capture=False)  # readings made after the capture would stay zeros
    w._ask_for_readings()
    w._init_widths(capture=False)
    assert w._widths.widths == (16, 32, 64)
    assert w.tree_head.reading_widths == (16, 32, 64)
    assert {w._widths.states[x] for x in (16, 32, 64)} == {("backend N", None)}
    assert w._choose_width(3) == 16 and w.speculative_num_draft_tokens == 16
    assert w.runtime.report()["widths_chosen"] == {"16": 1}


def RoundReadingsOnCpu(policy, buffer, widths):  # noqa: N802 - stands in for the class
    from sglang_ddtree.round.widths import RoundReadings

    return RoundReadings(policy, buffer, widths, event=FakeEvent)


def test_each_bucket_gets_its_own_refreshes():
    """Batches alternating between two buckets: both are refreshed (one round counter for all
    buckets once put every refresh in the same one)."""
    policy = WidthPolicy((16, 32), buckets=(1, 8), refresh=8)
    refreshed = {1: 0, 8: 0}
    for i in range(400):
        bs = 1 if i % 2 else 8
        width = policy.choose(bs)
        calibrated = all(policy.samples[policy.bucket(bs), w] >= policy.explore for w in (16, 32))
        if calibrated and width == 16:  # 32 costs less: 16 runs only when refreshed
            refreshed[bs] += 1
        policy.observe_cost(bs, width, {16: 30.0, 32: 10.0}[width])
    assert refreshed[1] > 10 and refreshed[8] > 10, refreshed


def test_a_width_that_does_not_fit_is_dropped_and_any_other_failure_stops_startup(monkeypatch):
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.round import widths

    runner = SimpleNamespace(
        attn_backend="backend N",
        decode_cuda_graph_runner="runner N",
        model_config=SimpleNamespace(context_len=8192),
    )
    built = []

    def build(model_runner, width):
        built.append(width)
        if width == 32:
            raise RuntimeError("Capture cuda graph failed: CUDA out of memory. Tried to allocate")
        return (f"backend {width}", f"runner {width}")

    monkeypatch.setattr(compat, "build_target_verify_state", build)
    monkeypatch.setattr(compat, "graph_batch_sizes", lambda runner: (1, 2, 4))
    kept = widths.VerifyWidths(runner, (16, 32, 64))
    assert built == [32, 16] and kept.widths == (16, 64)  # the widest first; 32 dropped
    assert kept.states[16] == ("backend 16", "runner 16") and kept.buckets == (1, 2, 4)
    built.clear()  # the free memory given decides (at tp > 1 the smallest of every rank's)
    assert widths.VerifyWidths(runner, (16, 32, 64), free_gb=lambda: 1.0).widths == (64,)
    assert built == []

    def broken(model_runner, width):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(compat, "build_target_verify_state", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        widths.VerifyWidths(runner, (16, 64))


def test_start_up_refuses_a_width_whose_graph_buffers_do_not_fit(monkeypatch):
    """Widths 16 to 256 at 16 running requests and a 262,144-token context: SGLang's FlashInfer
    backend gives each width's verify graphs max_bs x width x context x 5 bytes (int32 KV
    indices, a byte of mask), 2.5 GiB at 128 and 5 GiB at 256 (N's are SGLang's own). With
    2 GB free the server does not start, in one line naming the width, the bytes and the
    limit; with room every width is captured, the widest first."""
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.round import widths
    from sglang_ddtree.state.round_memory import verify_graph_bytes

    runner = SimpleNamespace(
        attn_backend=SimpleNamespace(num_wrappers=1),
        decode_cuda_graph_runner="runner N",
        model_config=SimpleNamespace(context_len=262144),
    )
    built = []
    monkeypatch.setattr(compat, "build_target_verify_state", lambda r, w: built.append(w) or (w, w))
    monkeypatch.setattr(compat, "graph_batch_sizes", lambda runner: (1, 2, 4, 8, 16))
    wide = (16, 32, 64, 128, 256)
    assert verify_graph_bytes(max_bs=16, width=128, context_len=262144) == 2684354560
    with pytest.raises(RuntimeError) as refused:
        widths.VerifyWidths(runner, wide, free_gb=lambda: 2.0)
    message = str(refused.value)
    assert "\n" not in message and built == []
    assert "verify width 128 needs 2684354560 bytes (2.50 GiB)" in message
    assert "past the 2147483648 bytes (2.00 GiB) free" in message
    assert "SGLANG_DDTREE_WIDTHS" in message and "--max-running-requests" in message
    kept = widths.VerifyWidths(runner, wide, free_gb=lambda: 100.0)
    assert kept.widths == wide and built == [128, 64, 32, 16]
    assert kept.graph_bytes(16) == 16 * 16 * 262144 * 5
    # buffers that fit with under MIN_FREE_GB to spare: dropped with a warning, as before
    built.clear()
    assert widths.VerifyWidths(runner, wide, free_gb=lambda: 4.0).widths == (16, 32, 64, 256)


def test_a_verify_without_cuda_graphs_is_warned_once_per_width_and_counted(monkeypatch, caplog):
    """An eager verify costs a small target a few ms of host time a round: the first at each
    width is logged while graphs are on, and every one is counted in the widths table."""
    from sglang_ddtree import config

    worker_mod, w = _worker()
    w.runtime = SimpleNamespace(options=config.Options.from_env())  # the factory's
    monkeypatch.setattr(
        worker_mod,
        "RoundReadings",
        lambda policy, buffer, widths: RoundReadingsOnCpu(policy, buffer, widths),
    )
    w._ask_for_readings()
    w._init_widths(capture=False)
    w._graphs_on, w._eager_warned = True, set()
    with caplog.at_level("WARNING", logger=worker_mod.logger.name):
        for bs, width in [(3, 16), (2, 16), (1, 32)]:
            w._note_eager_verify(bs, width)
    warned = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert warned == [
        "DDTREE: a verify at width 16, batch 3, ran without CUDA graphs (later "
        "ones are counted in the widths table)",
        "DDTREE: a verify at width 32, batch 1, ran without CUDA graphs (later "
        "ones are counted in the widths table)",
    ]
    assert w._readings.policy.eager == {16: 2, 32: 1}
    w._graphs_on = False  # no graphs at all: counted, not warned
    caplog.clear()
    w._eager_warned = set()
    w._note_eager_verify(1, 16)
    assert not caplog.records and w._readings.policy.eager[16] == 3


def test_the_draft_graphs_are_captured_after_the_readings_are_asked_for(monkeypatch):
    """init_cuda_graphs: the draft head's width readings exist when the draft graphs are
    captured (the graphs then write them every round), and the policy reads that buffer."""
    from sglang_ddtree import config

    worker_mod, w = _worker()
    w.runtime = SimpleNamespace(options=config.Options.from_env())  # the factory's
    monkeypatch.setattr(
        worker_mod,
        "RoundReadings",
        lambda policy, buffer, widths: RoundReadingsOnCpu(policy, buffer, widths),
    )
    disabled = SimpleNamespace(decode=SimpleNamespace(backend=worker_mod.Backend.DISABLED))
    monkeypatch.setattr(
        worker_mod,
        "get_exec",
        lambda: SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=disabled)),
    )
    at_capture = []
    monkeypatch.setattr(
        worker_mod.compat,
        "init_draft_cuda_graphs",
        lambda worker, capture: at_capture.append(worker.tree_head.readings),
    )
    w.init_cuda_graphs()
    assert at_capture and at_capture[0] is not None
    assert w._readings.buffer is at_capture[0]


def test_the_least_free_memory_is_sglangs_read_over_the_tp_cpu_group(monkeypatch):
    """compat.least_free_gb: SGLang's free-memory read with its MIN all-reduce over the TP
    group's CPU group, the one every rank's start-up captures are decided by."""
    pytest.importorskip("sglang.srt.distributed")
    from sglang_ddtree.adapter import compat

    calls = []
    monkeypatch.setattr(
        "sglang.srt.utils.get_available_gpu_memory", lambda *a, **k: calls.append((a, k)) or 7.5
    )
    monkeypatch.setattr(
        "sglang.srt.distributed.get_tp_group", lambda: SimpleNamespace(cpu_group="gloo group")
    )
    assert compat.least_free_gb("cuda", 1) == 7.5
    assert calls == [(("cuda", 1), {"distributed": True, "cpu_group": "gloo group"})]


def test_the_tp_cpu_group_is_sglangs(monkeypatch):
    """compat.tp_cpu_group reads SGLang's TP GroupCoordinator: its gloo group, the global rank
    of its first rank (the source of every shared width) and whether this process is it."""
    parallel_state = pytest.importorskip("sglang.srt.distributed.parallel_state")
    import inspect

    from sglang_ddtree.adapter import compat

    coordinator = parallel_state.GroupCoordinator
    assert isinstance(coordinator.first_rank, property)
    assert isinstance(coordinator.is_first_rank, property)
    assert "self.cpu_group = cpu_group" in inspect.getsource(coordinator.__init__)
    group = SimpleNamespace(cpu_group="gloo group", first_rank=4, is_first_rank=False)
    monkeypatch.setattr("sglang.srt.distributed.get_tp_group", lambda: group)
    assert compat.tp_cpu_group() == ("gloo group", 4, False)


def _world_rounds(rounds: int, num_nodes: int = 32, widths=(16, 32), seed: int = 2):
    """`rounds` independent rounds of the simulated narrative world through the server's draft
    head at N = num_nodes: its trees, their expected tokens at `widths` (the readings) and the
    world's target token at every node (scripts/simworld's head)."""
    import importlib
    import sys
    from pathlib import Path

    from sglang_ddtree.config import DDTreeConfig

    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    simulation = importlib.import_module("simworld.world")
    server = importlib.import_module("simworld.server")
    B, vocab = 16, 4096
    cfg = DDTreeConfig(block_size=B, num_nodes=num_nodes, topk=8)
    head = server.SimulatedHead(
        simulation.REGIMES["narrative"],
        lm_head_weight=torch.zeros(vocab, 1),
        vocab_size=vocab,
        cfg=cfg,
        max_bs=rounds,
    )
    head.read_widths(widths)
    g = torch.Generator().manual_seed(seed)
    position = torch.randint(0, 1 << 30, (rounds,), generator=g)
    ids = torch.zeros(rounds, B, dtype=torch.int64)
    ids[:, 0] = torch.randint(simulation.FIRST_ID, vocab, (rounds,), generator=g)
    head(torch.zeros(rounds * B, 1), ids.flatten(), (position[:, None] + torch.arange(B)).flatten())
    return head, head.readings[:rounds, : len(widths)].clone(), head.simulated_picks[:rounds]


def test_a_round_at_one_width_gives_what_each_narrower_width_would_have_accepted():
    """accepted_at_widths from a round's emitted tokens equals the accept walk of the truncated
    tree at every narrower width, for rounds run at N and at a narrower width, and under an
    accept length cut short (a stop or max_tokens): the cut applies to every width."""
    from sglang_ddtree.accept import accept_walk
    from sglang_ddtree.accept.budget import accepted_at_widths, truncate

    head, _, picks = _world_rounds(600, num_nodes=32)
    widths = (16, 24, 32)
    walked = {
        w: accept_walk(truncate(head.tree(600), w), picks[:, :w], 15).num_accepted + 1
        for w in (8, *widths)
    }
    assert (walked[32] > walked[16]).any() and (walked[16] > 1).any()  # the widths differ
    for run in (32, 16):
        tree = (
            head.tree(600, run) if run in head.cuts or run == 32 else truncate(head.tree(600), run)
        )
        accept = accept_walk(tree, picks[:, :run], 15)
        lens = accept.num_accepted + 1
        got = accepted_at_widths(tree, accept.emitted, lens.int(), (8, *widths))
        for i, w in enumerate((8, *widths)):
            assert torch.equal(got[:, i], walked[min(w, run)].float()), (run, w)
    cut = torch.full((600,), 3, dtype=torch.int32)  # every request stopped after 3 tokens
    accept = accept_walk(head.tree(600), picks, 15)
    got = accepted_at_widths(
        head.tree(600), accept.emitted, torch.minimum(cut, accept.num_accepted.int() + 1), widths
    )
    for i, w in enumerate(widths):
        assert torch.equal(got[:, i], torch.minimum(walked[w], cut.long()).float()), w


def test_the_worker_reads_the_accepted_tokens_at_each_width_from_the_rounds_result():
    """Round.accepted_at_widths: the round's emitted tokens (SGLang's next_token_ids, the
    accepted drafts then the bonus, per request) and accept lengths, through the round's tree."""
    from sglang_ddtree.accept import accept_walk
    from sglang_ddtree.accept.budget import truncate

    worker_mod, w = _worker(N=32)
    head, _, picks = _world_rounds(5, num_nodes=32)
    w.tree_head = head
    accept = accept_walk(head.tree(5), picks, 15)
    emitted = torch.cat([accept.emitted.clamp(min=0), torch.zeros(5, 4, dtype=torch.int64)], 1)
    result = SimpleNamespace(
        next_token_ids=emitted.int().flatten(), accept_lens=(accept.num_accepted + 1).int()
    )
    from sglang_ddtree.round.round import Round

    rnd = Round(worker=w, batch=None, bs=5, width=32, draft_input=None, tree=head.tree(5, 32))
    want = [
        accept_walk(truncate(head.tree(5), v), picks[:, :v], 15).num_accepted + 1 for v in (16, 32)
    ]
    got = rnd.accepted_at_widths(result, head.reading_widths)
    assert torch.equal(got, torch.stack(want, 1).float())


def test_a_width_the_policy_is_not_choosing_keeps_an_unbiased_reading_at_batch_1():
    """At batch 1 on the 27B table (16 and 32 cost 21.91 and 22.43 ms) in the simulated narrative
    world (a 16-node tree accepts 3.94 tokens a round, a 32-node one 4.32), rounds drawn from the
    world's own trees: the policy's ratio of accepted to predicted tokens for 16, the width it
    mostly does not run, stays within 5% of the world's, and it runs 32 in at least 85% of the
    rounds. Ratios averaged over the
    last few rounds read 16 at 3.02 on average (the reading that stopped the policy choosing
    it stays), and each width's ratio read on its own rounds alone let a lucky burst of 16 win."""
    import random

    from sglang_ddtree.accept import accept_walk
    from sglang_ddtree.accept.budget import truncate

    rounds = 4000
    head, predicted, picks = _world_rounds(rounds, num_nodes=32)
    accepted = torch.stack(
        [
            accept_walk(truncate(head.tree(rounds), w), picks[:, :w], 15).num_accepted + 1
            for w in (16, 32)
        ],
        1,
    ).float()
    truth = accepted.mean(0).tolist()
    ms = {16: 21.91, 32: 22.43}
    for seed in range(3):
        rng, policy = random.Random(seed), WidthPolicy((16, 32), buckets=(1, 2, 4, 8))
        for _ in range(3000):
            i = rng.randrange(rounds)
            width = policy.choose(1)
            policy.observe_cost(1, width, ms[width] * (1 + 0.02 * rng.gauss(0, 1)))
            got = accepted[i].tolist()
            narrower = {16: got[0]} if width == 32 else {}
            policy.observe_tokens(
                width, predicted[i].tolist(), got[(16, 32).index(width)], narrower
            )
        # its ratio of accepted to predicted tokens, against the world's (the predictions
        # themselves are the current rounds' average, alike for both widths)
        want = truth[0] / float(predicted[:, 0].mean())
        assert policy.ratio[16].ratio == pytest.approx(want, rel=0.05), seed
        assert policy.chosen[32] >= 0.85 * 3000, (seed, policy.chosen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_accepted_tokens_at_widths_take_no_host_sync_on_cuda():
    """What RoundReadings.finish gets every round, on the device without a host sync, and the
    same numbers as on the CPU."""
    from sglang_ddtree.accept import accept_walk
    from sglang_ddtree.accept.budget import accepted_at_widths
    from sglang_ddtree.tree import DraftTree
    from sglang_ddtree.tree.testing import no_host_sync

    head, _, picks = _world_rounds(64, num_nodes=32)
    accept = accept_walk(head.tree(64), picks, 15)
    lens = (accept.num_accepted + 1).int()
    want = accepted_at_widths(head.tree(64), accept.emitted, lens, (16, 32))
    tree = DraftTree(*(t.cuda() for t in head.tree(64)))
    emitted, lens = accept.emitted.cuda(), lens.cuda()
    with no_host_sync():
        got = accepted_at_widths(tree, emitted, lens, (16, 32))
    assert torch.equal(got.cpu(), want)
