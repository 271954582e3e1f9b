"""The target side of the reference engine: prefill, tree verify and commit (batch 1).

`HFTargetRunner` wraps a transformers causal LM (Qwen3ForCausalLM, Qwen3_5ForCausalLM or
Qwen3_5ForConditionalGeneration, text path) and keeps the model's own cache, created by the model
itself on prefill (`DynamicCache(config=...)`: KV layers for full attention, `LinearAttentionLayer`
conv + recurrent states for Gated DeltaNet, kept as state 0 of each layer's dict of states).

verify runs one tree through the model's layers with their own weights:
  attention layers   the N node queries attend to the whole committed prefix plus the tree nodes
                     they can see (additive 4-D mask), RoPE at committed_len + depth;
  Gated DeltaNet     per-node conv windows and recurrent states (see gdn_tree.py);
and keeps everything it produced (per-node KV and GDN states) aside until commit(path) writes the
accepted root-to-node path into the cache. The cache is never touched by verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sglang_ddtree.reference.gdn_tree import gdn_tree_forward

ATTENTION = "full_attention"
GDN = "linear_attention"
_MASKED_ATTENTION_IMPLS = ("eager", "sdpa")  # take an arbitrary additive 4-D mask


@dataclass
class TreeVerifyState:
    """Everything one verify produced, per layer, held until commit (also a test/debug hook)."""

    num_nodes: int
    parents: list[int]
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, Hkv, N, D]
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, Hkv, N, D]
    conv_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, C, k]
    recurrent_states: dict[int, torch.Tensor] = field(default_factory=dict)  # [N, Hv, Dk, Dv]


class _TreeKVView:
    """Stands in for the cache inside one attention call: returns committed KV + the tree's KV.

    Records the tree's KV for commit and leaves the cache itself untouched.
    """

    def __init__(self, cache, record: TreeVerifyState):
        self.cache = cache
        self.record = record

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a, **kw
    ):
        layer = self.cache.layers[layer_idx]
        self.record.keys[layer_idx] = key_states  # [1, Hkv, N, D]
        self.record.values[layer_idx] = value_states
        keys = torch.cat([layer.keys, key_states], dim=-2)  # [1, Hkv, P + N, D]
        values = torch.cat([layer.values, value_states], dim=-2)
        return keys, values


def text_model(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM or a VLM."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def tree_attention_mask(
    visibility: torch.Tensor, prefix_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """visibility [N, N] bool -> additive mask [1, 1, N, prefix_len + N]: prefix always visible."""
    n = visibility.shape[0]
    allowed = torch.cat(
        [torch.ones(n, prefix_len, dtype=torch.bool, device=visibility.device), visibility], dim=1
    )  # [N, P + N]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=visibility.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def ancestor_visibility(parents: list[int]) -> torch.Tensor:
    """parents [N] -> [N, N] bool, [i, j] = j is i or an ancestor of i."""
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    return vis


def gdn_cache_states(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet cache layer's live (conv window [B, C, k], recurrent state [B, Hv, Dk, Dv]).

    transformers 5.19's `LinearAttentionLayer` holds a dict of states per layer ({state_idx:
    tensor}); Qwen3.5's GDN uses state 0 only. The model's own decode step updates these tensors
    in place, so writes must be in place too.
    """
    return layer.conv_states[0], layer.recurrent_states[0]


def _decoder_layer(layer: nn.Module, hidden: torch.Tensor, mixer) -> torch.Tensor:
    """The Qwen3 / Qwen3.5 decoder layer around a token mixer (pre-norm, two residuals)."""
    hidden = hidden + mixer(layer.input_layernorm(hidden))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _validate_tree(
    tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, visibility: torch.Tensor
) -> list[int]:
    """Boundary checks of one tree; returns parents as a host list."""
    n = tokens.shape[0]
    if tokens.ndim != 1 or n == 0 or parents.shape != (n,) or depth.shape != (n,):
        raise ValueError(
            f"verify needs tokens, parents, depth of shape [N], got {tuple(tokens.shape)}, "
            f"{tuple(parents.shape)}, {tuple(depth.shape)}"
        )
    par, dep = parents.tolist(), depth.tolist()
    if par[0] != -1 or dep[0] != 0:
        raise ValueError(f"node 0 must be the root (parent -1, depth 0), got {par[0]}, {dep[0]}")
    for i in range(1, n):
        if not 0 <= par[i] < i or dep[i] != dep[par[i]] + 1:
            raise ValueError(
                f"node {i}: parent {par[i]} must be in [0, {i}) and depth {dep[i]} must be the "
                f"parent's depth + 1 (parents must be topological)"
            )
    expected = ancestor_visibility(par)
    if visibility.shape != (n, n) or not torch.equal(visibility.bool().cpu(), expected):
        raise ValueError("visibility must be the [N, N] ancestor-or-self mask of `parents`")
    return par


class HFTargetRunner:
    """TargetRunner over a transformers model: prefill, tree verify, commit (batch 1).

    Text-only prompts: every node's position is committed_len + depth, on all mrope sections.
    tap_layer_ids follow HF's hidden_states[i + 1] (so the last layer's tap is final-normed).
    """

    def __init__(self, model: nn.Module, tap_layer_ids: list[int]):
        self.model = model.eval()
        self.text_model = text_model(model)
        config = self.text_model.config
        self.num_layers: int = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None) or [ATTENTION] * self.num_layers
        self.layer_types: list[str] = list(layer_types)
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.max_position_embeddings: int = config.max_position_embeddings
        self.tap_layer_ids = list(tap_layer_ids)
        self._check_supported(config)
        self.cache = None
        self.committed_len = 0
        self._pending: TreeVerifyState | None = None

    def _check_supported(self, config) -> None:
        unknown = sorted(set(self.layer_types) - {ATTENTION, GDN})
        if unknown:
            raise ValueError(
                f"HFTargetRunner supports {ATTENTION!r} and {GDN!r} layers, got {unknown}"
            )
        impl = config._attn_implementation
        if ATTENTION in self.layer_types and impl not in _MASKED_ATTENTION_IMPLS:
            raise ValueError(
                f"tree verify needs an attention implementation that takes a 4-D mask "
                f"{_MASKED_ATTENTION_IMPLS}, got {impl!r}: load with attn_implementation='sdpa'"
            )
        bad = [t for t in self.tap_layer_ids if not 0 <= t < self.num_layers]
        if bad:
            raise ValueError(f"tap layer ids must be in [0, {self.num_layers}), got {bad}")

    @property
    def last_verify(self) -> TreeVerifyState | None:
        """Per-node KV and GDN states of the last verify (None after commit)."""
        return self._pending

    # ---- prefill -------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] int64 -> (logits [T, V] float32, taps [T, n_taps * hidden]); fresh cache."""
        if input_ids.ndim != 1 or input_ids.numel() == 0:
            raise ValueError(
                f"prefill needs a non-empty [T] prompt, got shape {tuple(input_ids.shape)}"
            )
        out = self.model(input_ids=input_ids[None], use_cache=True, output_hidden_states=True)
        self.cache = out.past_key_values  # the model's own cache class, built by the model
        self.committed_len = input_ids.shape[0]
        self._pending = None
        taps = torch.cat([out.hidden_states[i + 1][0] for i in self.tap_layer_ids], dim=-1)
        return out.logits[0].float(), taps

    # ---- verify --------------------------------------------------------------------------------

    @torch.no_grad()
    def verify(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depth: torch.Tensor,
        visibility: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree (node 0 = root at committed_len) -> (logits [N, V] f32, taps [N, n_taps*H]).

        Node i is computed as if its root-to-node path followed the committed sequence. The cache
        is left as it was; commit(path) applies the accepted nodes.
        """
        if self.cache is None:
            raise RuntimeError("verify before prefill: call prefill(prompt) first")
        par = _validate_tree(tokens, parents, depth, visibility)
        record = TreeVerifyState(num_nodes=len(par), parents=par)
        tm, device = self.text_model, tokens.device
        positions = (self.committed_len + depth).to(device)[None]  # [1, N]
        hidden = tm.embed_tokens(tokens[None])  # [1, N, H]
        rope = tm.rotary_emb(hidden, positions)  # text positions: same on every mrope section
        mask = tree_attention_mask(visibility.to(device), self.committed_len, hidden.dtype)
        kv_view = _TreeKVView(self.cache, record)
        parents_dev = parents.to(device)

        states = [hidden]  # HF hidden_states: embeddings, then every layer's output
        for idx, layer in enumerate(tm.layers[: self.num_layers]):
            if self.layer_types[idx] == GDN:
                mixer = self._gdn_mixer(idx, layer.linear_attn, parents_dev, record)
            else:
                mixer = self._attention_mixer(layer.self_attn, rope, mask, kv_view)
            hidden = _decoder_layer(layer, hidden, mixer)
            states.append(hidden)
        states[-1] = tm.norm(hidden)  # HF ties hidden_states[-1] to the final-normed output
        logits = self.model.lm_head(states[-1])[0].float()  # [N, V]
        taps = torch.cat([states[i + 1][0] for i in self.tap_layer_ids], dim=-1)
        self._pending = record
        return logits, taps

    @staticmethod
    def _attention_mixer(attn: nn.Module, rope, mask: torch.Tensor, kv_view: _TreeKVView):
        def mixer(x: torch.Tensor) -> torch.Tensor:
            out, _ = attn(
                hidden_states=x,
                position_embeddings=rope,
                attention_mask=mask,
                past_key_values=kv_view,
            )
            return out

        return mixer

    def _gdn_mixer(self, idx: int, gdn: nn.Module, parents: torch.Tensor, record: TreeVerifyState):
        conv, ssm = gdn_cache_states(self.cache.layers[idx])

        def mixer(x: torch.Tensor) -> torch.Tensor:
            res = gdn_tree_forward(gdn, x[0], parents, conv[0], ssm[0])
            record.conv_states[idx] = res.conv_states
            record.recurrent_states[idx] = res.recurrent_states
            return res.out[None]

        return mixer

    # ---- commit --------------------------------------------------------------------------------

    @torch.no_grad()
    def commit(self, path: torch.Tensor) -> None:
        """path [a+1] node indices root-first (trailing -1 padding allowed): keep those nodes."""
        if self._pending is None:
            raise RuntimeError("commit without a pending verify: call verify(...) first")
        nodes = self._validate_path(path)
        index = torch.tensor(nodes, dtype=torch.int64)
        for idx, kind in enumerate(self.layer_types):
            if kind == GDN:
                self._gdn_commit(idx, nodes[-1])
            else:
                self._attention_keep(idx, index)
        self.committed_len += len(nodes)
        self._pending = None

    def _validate_path(self, path: torch.Tensor) -> list[int]:
        nodes = [int(p) for p in path.tolist() if p >= 0]
        par = self._pending.parents
        ok = bool(nodes) and nodes[0] == 0
        ok = ok and all(
            0 < b < len(par) and par[b] == a for a, b in zip(nodes, nodes[1:], strict=False)
        )
        if not ok:
            raise ValueError(
                f"commit path must be a root-first chain of the verified tree, got {nodes}"
            )
        return nodes

    def _attention_keep(self, idx: int, nodes: torch.Tensor) -> None:
        """Append the KV of the accepted nodes (root-first) after the committed prefix."""
        layer = self.cache.layers[idx]
        keys, values = self._pending.keys[idx], self._pending.values[idx]  # [1, Hkv, N, D]
        nodes = nodes.to(keys.device)
        layer.keys = torch.cat([layer.keys, keys[:, :, nodes]], dim=-2)
        layer.values = torch.cat([layer.values, values[:, :, nodes]], dim=-2)

    def _gdn_commit(self, idx: int, node: int) -> None:
        """Conv window and recurrent state after the deepest accepted node become the live ones."""
        conv, ssm = gdn_cache_states(self.cache.layers[idx])
        conv.copy_(self._pending.conv_states[idx][node][None])  # in place, like HF's decode step
        ssm.copy_(self._pending.recurrent_states[idx][node][None])

    # ---- ground truth --------------------------------------------------------------------------

    def greedy_generate_plain(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Plain greedy decode with the model's own cache (independent of this runner's state)."""
        return plain_greedy_generate(self.model, input_ids, max_new_tokens)


@torch.no_grad()
def plain_greedy_generate(
    model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """input_ids [T] -> [max_new_tokens] int64: argmax decode, one cached token per forward."""
    if max_new_tokens <= 0:
        return input_ids.new_empty(0)
    out = model(input_ids=input_ids[None], use_cache=True)  # the model builds its own cache
    cache, generated = out.past_key_values, []
    for _ in range(max_new_tokens):
        token = out.logits[0, -1].float().argmax()
        generated.append(token)
        if len(generated) < max_new_tokens:
            out = model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
    return torch.stack(generated)
