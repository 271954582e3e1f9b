"""The shape of a call's per-prompt fields, checked before SGLang splits the call into requests.

SGLang 0.5.23's `GenerateReqInput.normalize_batch_and_arguments` takes a field of a batch of B
prompts either as one value for every prompt or as a list of one value per prompt, and then
`__getitem__` indexes that list by prompt (`_init_req_state` does it for every prompt, before any
per-request check). It checks the list's length for a few fields (rid, image_data, watermark,
return_hidden_states, mm_hashes, extra_key, cache_salt, kv_hints) and for the rest not at all:
a list shorter than the batch raised IndexError there (HTTP 500; a streamed /generate: a 200
whose stream ends without an event), a longer one was cut silently, and for one prompt a list
was passed on as it came (the scheduler reads these fields as one bool or int per request).

`check_shape` refuses, naming the field and both lengths: a per-prompt list whose length is not
the batch's, a list where one prompt takes one value, a list inside a per-prompt list, and a mix
of ids and id lists. A call of one prompt with n > 1 is a batch of one, as SGLang makes it.
"""

from __future__ import annotations

from sglang_ddtree.front_door.request_limits import UNSERVED
from sglang_ddtree.front_door.values import show

# Fields that take one value per prompt (a list of them for a batch). SGLang expands some of
# them by n and raises ValueError for others with n > 1 itself; either way B entries is right.
ONE_PER_PROMPT = (
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_hidden_states",
    "custom_logit_processor",
    "lora_path",
    "lora_id",
    "watermark",
    "extra_key",
    "cache_salt",
    "kv_hints",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "positional_embed_overrides",
)
# Fields whose one value is itself a list of ints: one list for every prompt, or (a batch) one
# list per prompt; SGLang indexes the last two by prompt whatever they hold
ID_LISTS = ("token_ids_logprob",)
LIST_PER_PROMPT = ("multi_item_delimiter_indices", "token_indices_to_pool")
# Media: one item (or a list of items) for one prompt; a batch's list has one entry per prompt
MEDIA = ("image_data", "video_data", "audio_data")
# Fields DDTREE does not serve that SGLang reads before any per-request check: input_embeds
# sizes the batch (input_embeds[0][0]: [] and [[]] raised IndexError), the other two are
# indexed by prompt whatever they hold (a dict: KeyError)
UNSERVED_EARLY = ("input_embeds", "positional_embed_overrides", "lora_id")


def call_shape(obj) -> tuple[bool, int]:
    """(one prompt, prompts) as SGLang's _determine_batch_size reads them (text first, then
    input_ids; input_embeds is not served), a call of one prompt with n > 1 being a batch."""
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    if text is not None:
        single, prompts = not isinstance(text, list), len(text) if isinstance(text, list) else 1
    elif isinstance(ids, list) and ids and isinstance(ids[0], list):
        single, prompts = False, len(ids)
    else:
        single, prompts = True, 1
    return single and samples(obj) <= 1, prompts


def samples(obj) -> int:
    """n, as SGLang reads it (the first sampling_params of a list); 1 where it is not a number."""
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, list):
        params = params[0] if params else None
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def check_shape(obj) -> None:
    """Raise ValueError for the first per-prompt field of a call (SGLang's GenerateReqInput
    before normalize_batch_and_arguments) whose shape does not match its prompts."""
    for name in UNSERVED_EARLY:
        value = getattr(obj, name, None)
        if value is not None and value is not False:
            raise ValueError(f"{name}={show(value)} is not served by DDTREE: {UNSERVED[name]}.")
    single, prompts = call_shape(obj)
    for name in ONE_PER_PROMPT:
        value = getattr(obj, name, None)
        if not isinstance(value, list):
            continue
        _length(name, value, single, prompts)
        for i, item in enumerate(value):
            if isinstance(item, list):
                raise ValueError(
                    f"{name}[{i}]={show(item)} is a list: {name} takes one value per prompt."
                )
            if name == "sampling_params" and not isinstance(item, dict):
                raise ValueError(f"sampling_params[{i}] must be a JSON object, got {show(item)}.")
    for name in ID_LISTS + LIST_PER_PROMPT:
        _check_id_lists(name, getattr(obj, name, None), single, prompts)
    for name in MEDIA:
        value = getattr(obj, name, None)
        if not single and isinstance(value, list) and (value or name != "image_data"):
            _length(name, value, single, prompts)
    modalities = getattr(obj, "modalities", None)
    if not single and modalities and getattr(obj, "image_data", None) is None:
        _length("modalities", modalities, single, prompts)  # SGLang indexes it by prompt


def _length(name: str, value: list, single: bool, prompts: int) -> None:
    if single:
        raise ValueError(
            f"{name} is a list of {len(value)} for one prompt: give it one value (a list is "
            "one value per prompt of a batch)."
        )
    if len(value) != prompts:
        raise ValueError(
            f"{name} has {len(value)} entries for {prompts} prompts: give one per prompt, or "
            "one value for all of them."
        )


def _check_id_lists(name: str, value, single: bool, prompts: int) -> None:
    """A list of ints for every prompt, or (a batch) a list of one such list per prompt; for
    LIST_PER_PROMPT a batch must give the per-prompt form (SGLang indexes it by prompt)."""
    if not isinstance(value, list) or not value:
        return
    nested = [isinstance(item, list) for item in value]
    if any(nested) and not all(nested):
        raise ValueError(
            f"{name}={show(value)} mixes ids and lists of ids: give one list of ids"
            + ("" if single else ", or one list per prompt")
            + "."
        )
    if all(nested):
        if single:
            raise ValueError(
                f"{name} holds {len(value)} lists of ids for one prompt: give one list of ids."
            )
        _length(name, value, single, prompts)
        for i, item in enumerate(value):
            if any(isinstance(x, list) for x in item):
                raise ValueError(f"{name}[{i}]={show(item)} holds a list: give ids.")
    elif name in LIST_PER_PROMPT and not single:
        raise ValueError(
            f"{name} is one list of {len(value)} ids for {prompts} prompts: a batch gives "
            "one list per prompt."
        )
