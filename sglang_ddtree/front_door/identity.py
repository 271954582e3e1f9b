"""Request ids: what a client may name its requests on a DDTREE server (`rid` on /generate and
the OpenAI routes, `request_id` on /v1/responses).

SGLang 0.5.23 keys every request's state by its id (`TokenizerManager.rid_to_state`) and
matches ids by prefix in three places, which make a client's id reach other requests:
- **Aborts are by prefix.** A client that disconnects aborts its id, and the scheduler aborts
  every request whose id *begins* with it (`Scheduler.abort_request`: `req.rid.startswith(...)`);
  so a request named "a" that goes away ends every "a..." request, other clients' included, and
  a request named "3" a sixteenth of the server's own ids (uuid4 hex). An empty id is never
  aborted at all (`abort_request` ignores it: it would match every request).
- **"HEALTH_CHECK" ids are the health check's.** The scheduler drops a request whose id begins
  with it while it is busy (it only acknowledges a health check then), the tokenizer manager
  ignores its aborts, and the metrics skip any id that holds it: such a request never answers,
  its state is never released, and a graceful shutdown waits for it.
- **Duplicates and the type.** SGLang refuses an id already in flight and a duplicate in a batch
  (ValueError, a 400) but keys its dict by a list when one prompt comes with a list of ids
  (TypeError: a 500).

`check_ids` refuses, naming the id and the rule: an id that is not a string (one prompt) or a
list of one string per prompt (a batch: a single string becomes "<id>_<i>"); an empty one, one
over MAX_RID_CHARS characters or with unprintable ones; one that holds RESERVED; one that is the
start of an id SGLang makes itself (1-31 hex digits, "resp_" + up to 31); two of one call of
which one begins the other; and one of which an in-flight id is the start, or the reverse (the
in-flight ids are the tokenizer manager's own `rid_to_state`, read at the call).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Collection

from sglang_ddtree.front_door.values import show

MAX_RID_CHARS = 256
RESERVED = "HEALTH_CHECK"  # SGLang's HEALTH_CHECK_RID_PREFIX (sglang.srt.constants)
# The ids SGLang makes itself: a prefix and uuid4().hex (32 lowercase hex digits). None of them
# may have a client's id as its start.
GENERATED = ("", "resp_", RESERVED + "_")
_HEX = re.compile(r"[0-9a-f]*")
UUID_HEX = 32


def check_ids(rid, single: bool, prompts: int, in_flight: Collection[str] = ()) -> None:
    """Raise ValueError for the first request id of a call (`rid` as the client gave it; None:
    SGLang names the requests) that a DDTREE server does not take."""
    if rid is None:
        return
    if isinstance(rid, list):
        if single:
            raise ValueError(
                f"rid={show(rid)} is a list for one prompt: give one request id (a string)."
            )
        if len(rid) != prompts:
            raise ValueError(
                f"rid has {len(rid)} ids for {prompts} prompts: give one per prompt, or one "
                "string (SGLang appends _0, _1, ... to it)."
            )
        ids = rid
    else:
        ids = [rid]
    for value in ids:
        _check_one(value)
    _check_apart(ids, in_flight)


def _check_one(rid) -> None:
    if not isinstance(rid, str):
        raise ValueError(f"rid must be a string (a request id), got {show(rid)}.")
    if not 1 <= len(rid) <= MAX_RID_CHARS or not rid.isprintable():
        raise ValueError(
            f"rid={show(rid)}: a request id is 1 to {MAX_RID_CHARS} printable characters, got "
            f"{len(rid)}{'' if rid.isprintable() else ' with unprintable ones'} (SGLang never "
            "aborts an empty id, and writes ids to its logs)."
        )
    if RESERVED in rid:
        raise ValueError(
            f"rid={show(rid)} holds {RESERVED!r}, which SGLang reserves for its own health "
            "checks (its scheduler drops such a request while busy and its tokenizer manager "
            "ignores its aborts: it would never answer); use another id."
        )
    made = next((p for p in GENERATED if _starts_generated(rid, p)), None)
    if made is not None:
        raise ValueError(
            f"rid={show(rid)} is the start of ids SGLang makes itself ({made!r} + 32 hex "
            "digits): SGLang aborts by prefix (a client that disconnects aborts every request "
            "whose id begins with its own), so this id's abort would end other requests; use "
            "an id that is not the start of one of those."
        )


def _starts_generated(rid: str, prefix: str) -> bool:
    """Whether `rid` is a proper start of some prefix + uuid4().hex."""
    if len(rid) >= len(prefix) + UUID_HEX:
        return False
    if len(rid) <= len(prefix):
        return prefix.startswith(rid)
    return rid.startswith(prefix) and _HEX.fullmatch(rid, len(prefix)) is not None


def _check_apart(ids: list[str], in_flight: Collection[str]) -> None:
    """No id of the call begins another or an in-flight one, nor has an in-flight one as its
    start (an equal id included): each one's abort ends only its own request."""
    ordered = sorted(ids)
    for a, b in zip(ordered, ordered[1:], strict=False):  # a prefix sorts just before its heirs
        if b.startswith(a):
            same = "twice" if a == b else f"and {show(b)}, which begins with it"
            raise ValueError(
                f"rid holds {show(a)} {same}: SGLang aborts by prefix, so one's abort would "
                "end the other; give each prompt an id no other begins with."
            )
    if not in_flight:
        return
    flying = sorted(in_flight)
    known = set(flying)
    for rid in ids:
        at = bisect.bisect_left(flying, rid)
        heir = at < len(flying) and flying[at].startswith(rid)
        if heir or any(rid[:k] in known for k in range(1, len(rid))):
            what = "is in flight" if rid in known else "and an in-flight request's id begin"
            raise ValueError(
                f"rid={show(rid)} {what}"
                + ("" if rid in known else " one with the other")
                + ": SGLang aborts by prefix (a client that disconnects aborts every request "
                "whose id begins with its own), so one's abort would end the other; use an id "
                "no in-flight id begins with, or wait for that request to finish."
            )
