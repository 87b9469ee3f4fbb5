"""Attention with its KV-cache update: one op per layer, standard first, then onnxruntime's.

torch.onnx lowers SDPA to a standard `Attention` op (opset 23) but leaves the KV cache
around it: the cache update is a `Concat` and grouped-query attention repeats every KV
head with `Unsqueeze` / `Expand` / `Reshape` before attending. Two rule sets:

- `attention_fusion` (portable): the cache update and the head repeat move into the
  `Attention` op itself (its `past_key` / `past_value` inputs, `present_*` outputs),
  which handles grouped heads natively. Standard ops only.
- `attention_lowering_ort`: that `Attention` becomes onnxruntime's `GroupQueryAttention`,
  which can write the new keys and values in place into a preallocated cache that
  past and present share (the contract's `shared` KV mode): decode reads the cache
  but never copies it, so its cost stays flat as the context grows. The graph's mask
  (causal, padding, sliding window) becomes GQA's additive `attention_bias`, so
  left-padded batches and windowed layers mean exactly what they meant before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult

from kvforge.passes.fuse_rotary import PositionTables, table_frequencies
from kvforge.passes.rewrite import FusionPass

_BHSD_TO_BSHD = [0, 2, 1, 3]


def _static_heads(value: ir.Value | None, what: str, result: MatchResult) -> tuple[int, int] | None:
    """(heads, head_dim) of a [batch, heads, seq, head_dim] value, or None after recording why not."""
    shape = value.shape if value is not None else None
    if shape is None or len(shape) != 4:
        result.fail(f"{what} is not known to be 4-D [batch, heads, seq, head_dim]", value)
        return None
    heads, head_dim = shape[1], shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        result.fail(f"{what} has no static head count or head size (shape {shape})", value)
        return None
    return heads, head_dim


def _bsd_source(x: ir.Value) -> ir.Value | None:
    """`s` when x = Transpose(Reshape(s, [.., .., H, D]), perm 0213) and s is [B, S, H*D]."""
    found = _heads_of(x, normed=False)
    return None if found is None else found[0]


def _heads_of(x: ir.Value, normed: bool) -> tuple[ir.Value, ir.Node | None] | None:
    """(s, None) when x [B,H,S,D] = Transpose(Reshape(s, [.., .., H, D]), perm 0213) and s is
    [B, S, H*D]; where `normed`, also (s, norm) when an RMSNormalization of each head alone
    (`_head_norm`) sits before or after the Transpose (gemma3's and qwen3's query and key
    norms): it commutes with the heads' order."""
    norm = _head_norm(x) if normed else None
    inner = x if norm is None else norm.inputs[0]
    transpose = None if inner is None else inner.producer()
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain != "":
        return None
    below = transpose.inputs[0]
    if list(_attribute(transpose, "perm", [])) != _BHSD_TO_BSHD or below is None:
        return None
    if normed and norm is None and (norm := _head_norm(below)) is not None:
        below = norm.inputs[0]
    reshape = None if below is None else below.producer()
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain != "" or reshape.inputs[0] is None:
        return None
    source = reshape.inputs[0]
    heads = _static_heads(x, "x", MatchResult())
    if heads is None or source.shape is None or len(source.shape) != 3 or source.shape[2] != heads[0] * heads[1]:
        return None
    return source, norm


def _rotary_of_bsd(x: ir.Value) -> tuple[ir.Value, ir.Node | None, ir.Value, ir.Value, dict[str, Any]] | None:
    """(s, norm, cos, sin, attributes) when x = RotaryEmbedding(heads of s [B,S,H*D], cos, sin)
    with no position ids, each head perhaps RMS-normalized first (`norm`, `_heads_of`)."""
    rotary = x.producer()
    if rotary is None or rotary.op_type != "RotaryEmbedding" or rotary.domain != "" or len(rotary.inputs) != 3:
        return None
    split, cos, sin = rotary.inputs
    found = _heads_of(split, normed=True) if split is not None else None
    if found is None or cos is None or sin is None:
        return None
    attributes = {k: a.value for k, a in rotary.attributes.items() if k in ("interleaved", "rotary_embedding_dim")}
    return found[0], found[1], cos, sin, attributes


def _head_norm(x: ir.Value) -> ir.Node | None:
    """The RMSNormalization making 4-D `x` ([B,H,S,D] or [B,S,H,D]) when it normalizes over the
    head size D alone, with a scale of shape [D], and `x` has no other use."""
    norm = x.producer()
    if norm is None or norm.op_type != "RMSNormalization" or norm.domain != "" or len(norm.inputs) != 2:
        return None
    scale = norm.inputs[1]
    if x.shape is None or len(x.shape) != 4 or scale is None or scale.shape is None:
        return None
    if _attribute(norm, "axis", -1) not in (-1, 3) or list(scale.shape) != [x.shape[3]] or len(x.uses()) != 1:
        return None
    return norm


def _is_read(value: ir.Value) -> bool:
    """Used by a node or returned by the graph (`uses()` counts only the former)."""
    return bool(value.uses()) or value.is_graph_output()


def _graph_inputs(graph: ir.Graph, *names: str) -> list[ir.Value | None]:
    """The graph's inputs of these names, None for one it does not have."""
    inputs = {v.name: v for v in graph.inputs}
    return [inputs.get(name) for name in names]


def _attribute(node: ir.Node, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


class AttentionWithCache(pattern.RewriteRuleClassBase):
    """The cache update and KV-head repeat around an `Attention` move into the op.

    ```
    past_k  k_new              past_v  v_new
       Concat(axis=-2) ──► present_k   Concat ──► present_v
          │ [repeat: Unsqueeze(2) → Expand → Reshape]   │ [repeat ...]
    q ─► Attention(q, K, V, mask) ──► y
    ```
    becomes `y, present_k, present_v = Attention(q, k_new, v_new, mask, past_k, past_v)`.
    `repeat=False` is the plain multi-head form (as many KV heads as query heads).
    """

    def __init__(self, repeat: bool) -> None:
        super().__init__("AttentionWithCache" + ("GQA" if repeat else "MHA"), remove_nodes=False)
        self._repeat = repeat

    def _repeated(self, op: Any, present: Any, which: str) -> Any:
        if not self._repeat:
            return present
        grouped = op.Expand(op.Unsqueeze(present, [2]), pattern.ANY_VALUE)
        return op.Reshape(grouped, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=[f"{which}_all"])

    def pattern(self, op: Any, q: Any, k: Any, v: Any, past_k: Any, past_v: Any, mask: Any) -> Any:
        present_k = op.Concat(past_k, k, axis=-2, _outputs=["present_k"])
        present_v = op.Concat(past_v, v, axis=-2, _outputs=["present_v"])
        y = op.Attention(
            q,
            self._repeated(op, present_k, "k"),
            self._repeated(op, present_v, "v"),
            mask,
            _allow_other_attributes=True,
            _outputs=["y"],
        )
        return y, present_k, present_v

    def check(  # type: ignore[override]
        self, context: Any, q: Any, k: Any, past_k: Any, mask: Any, y: Any, **values: Any
    ) -> MatchResult:
        result = MatchResult()
        attention = y.producer()
        if _attribute(attention, "is_causal", 0):
            # With a cache, Attention's causal flag aligns to the top-left corner, not to the
            # end of the cache; only an explicit mask keeps the meaning the model had.
            return result.fail("is_causal=1: the fused form needs the explicit mask", attention)
        if len(attention.outputs) > 1 and any(_is_read(o) for o in attention.outputs[1:]):
            return result.fail("the Attention op already has cache outputs in use", attention)
        query = _static_heads(q, "query", result)
        key = _static_heads(k, "new keys", result)
        if query is None or key is None:
            return result
        (heads, head_dim), (kv_heads, kv_head_dim) = query, key
        if head_dim != kv_head_dim:
            return result.fail(f"query head size {head_dim} differs from key head size {kv_head_dim}", k)
        if not self._repeat and heads != kv_heads:
            return result.fail(f"{heads} query heads over {kv_heads} KV heads without a repeat", k)
        if self._repeat:
            if heads % kv_heads:
                return result.fail(f"{heads} query heads are not a multiple of {kv_heads} KV heads", k)
            for which in ("k", "v"):
                repeated = _static_heads(values[f"{which}_all"], f"repeated {which}", result)
                if repeated != (heads, head_dim):
                    return result.fail(f"repeated {which} does not have {heads} heads of size {head_dim}")
        return result

    def rewrite(self, op: Any, q: Any, k: Any, v: Any, past_k: Any, past_v: Any, mask: Any, y: Any, **_: Any) -> Any:
        attributes = {name: attr.value for name, attr in y.producer().attributes.items()}
        return op.Attention(q, k, v, mask, past_k, past_v, **attributes, _outputs=3)


class _CachedAttentionLowering(pattern.RewriteRuleClassBase):
    """What both lowerings of `y, present_k, present_v = Attention(q, k, v, mask, past_k, past_v)` match,
    and the conditions both need: the QK product unused, and causality given by the mask."""

    def pattern(self, op: Any, q: Any, k: Any, v: Any, mask: Any, past_k: Any, past_v: Any) -> Any:
        return op.Attention(
            q, k, v, mask, past_k, past_v, _allow_other_attributes=True, _outputs=["y", "present_k", "present_v"]
        )

    @staticmethod
    def _common_check(attention: ir.Node, result: MatchResult, target: str) -> bool:
        if len(attention.outputs) > 3 and _is_read(attention.outputs[3]):
            result.fail("the QK product output is used", attention)
            return False
        if _attribute(attention, "is_causal", 0):
            result.fail(f"is_causal=1: {target} needs the explicit mask", attention)
            return False
        return True


class AttentionToGroupQueryAttention(_CachedAttentionLowering):
    """A standard `Attention` with cache becomes onnxruntime's `GroupQueryAttention`.

    ```
    y, present_k, present_v = Attention(q, k, v, mask, past_k, past_v)      [B,H,S,D] 4-D
    ```
    becomes
    ```
    out, present_k, present_v = com.microsoft.GroupQueryAttention(
        q', k', v', past_k, past_v, seqlens_k = T-1 per row, total_sequence_length = T,
        attention_bias = Where(mask, 0, lowest))             q' = [B,S,H*D] (Transpose, Reshape)
    y = Transpose(Reshape(out, [B,S,H,D]))
    ```
    T is the mask's last dimension (past plus new positions). Every row keeps T slots,
    padding included, exactly as the mask has them, so positions and the cache layout are
    those of the standard graph and the runner may share one buffer for past and present.
    """

    def __init__(self) -> None:
        super().__init__("AttentionToGroupQueryAttention", remove_nodes=False)

    def check(  # type: ignore[override]
        self, context: Any, q: Any, k: Any, mask: Any, past_k: Any, y: Any, **_: Any
    ) -> MatchResult:
        result = MatchResult()
        attention = y.producer()
        if not self._common_check(attention, result, "GroupQueryAttention, which takes it as a bias,"):
            return result
        if mask is None or mask.dtype is None:
            return result.fail("no mask, or a mask of unknown type", attention)
        if mask.shape is None or len(mask.shape) != 4:
            return result.fail("the mask is not 4-D [batch, 1, seq, total]", mask)
        if q.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return result.fail(f"query dtype {q.dtype} is not float32 or float16", q)
        if past_k is None or past_k.dtype != q.dtype:
            return result.fail("the cache dtype differs from the query dtype", past_k)
        query = _static_heads(q, "query", result)
        key = _static_heads(k, "keys", result)
        if query is None or key is None:
            return result
        if query[1] != key[1] or query[0] % key[0]:
            return result.fail(f"query heads/size {query} do not group over key heads/size {key}", k)
        return result

    def rewrite(self, op: Any, q: Any, k: Any, v: Any, mask: Any, past_k: Any, past_v: Any, y: Any, **_: Any) -> Any:
        attention = y.producer()
        heads, head_dim = q.shape[1], q.shape[3]
        dtype = q.dtype.numpy()
        to_3d = op.Constant(value_ints=[0, 0, -1])

        def packed(x: Any) -> Any:
            bsd = _bsd_source(x)
            if bsd is not None:  # x was [B,S,H*D] split into heads: take it as it was
                return bsd
            rotated = _rotary_of_bsd(x)
            if rotated is not None:  # rotate [B,S,H*D] directly, as RotaryEmbedding-23 allows
                source, norm, cos, sin, attributes = rotated
                if norm is not None:  # each head normalized as [B,S,H,D]: no transpose either way
                    heads_last = op.Reshape(source, op.Constant(value_ints=[0, 0, x.shape[1], x.shape[3]]))
                    kept = {k: a.value for k, a in norm.attributes.items() if k != "axis"}
                    source = op.Reshape(op.RMSNormalization(heads_last, norm.inputs[1], axis=-1, **kept), to_3d)
                return op.RotaryEmbedding(source, cos, sin, num_heads=x.shape[1], **attributes)
            return op.Reshape(op.Transpose(x, perm=_BHSD_TO_BSHD), to_3d)

        if mask.dtype == ir.DataType.BOOL:
            zero = op.Constant(value=ir.tensor(np.array(0, dtype=dtype)))
            lowest = op.Constant(value=ir.tensor(np.array(np.finfo(dtype).min, dtype=dtype)))
            bias = op.Where(mask, zero, lowest)
        else:
            bias = mask
        total = op.Shape(mask, start=3, end=4)
        one = op.Constant(value_ints=[1])
        # The batch from the mask every layer shares, so one seqlens serves all layers after CSE
        # (not q's: the rotated q may be rebuilt from [B,S,H*D]); a broadcast mask has batch 1.
        batch = op.Shape(past_k if mask.shape[0] == 1 else mask, start=0, end=1)
        seqlens = op.Expand(op.Cast(op.Sub(total, one), to=ir.DataType.INT32), batch)
        total_scalar = op.Cast(op.Squeeze(total), to=ir.DataType.INT32)
        attributes: dict[str, Any] = {"num_heads": heads, "kv_num_heads": k.shape[1]}
        for name in ("scale", "softcap"):
            if name in attention.attributes:
                attributes[name] = float(attention.attributes[name].value)
        out, present_k, present_v = op.GroupQueryAttention(
            packed(q),
            packed(k),
            packed(v),
            past_k,
            past_v,
            seqlens,
            total_scalar,
            None,
            None,
            None,
            bias,
            _domain="com.microsoft",
            _outputs=3,
            **attributes,
        )
        split = op.Constant(value_ints=[0, 0, heads, head_dim])
        return op.Transpose(op.Reshape(out, split), perm=_BHSD_TO_BSHD), present_k, present_v


class RotaryInAttention(InPlacePass):
    """Each layer's q/k rotation moves into its GroupQueryAttention, which then reads the packed
    q/k/v projection as it is: three nodes fewer per layer, and no copy of q, k and v.

    ```
    q, k, v = Split(qkv)                                    [B,S,H*D], [B,S,Hkv*D], [B,S,Hkv*D]
    out, .. = GroupQueryAttention(RotaryEmbedding(q, Cos(freqs), Sin(freqs)),
                                  RotaryEmbedding(k, Cos(freqs), Sin(freqs)), v, ..)
    ```
    becomes
    ```
    out, .. = GroupQueryAttention(qkv, -, -, .., cos_cache, sin_cache, position_ids, ..,
                                  query_seqlens = S per row, do_rotary=1)
    ```
    `cos_cache` / `sin_cache` are `freqs` evaluated for positions 0 .. `max_positions` - 1
    (`fuse_rotary.PositionTables`: the values the graph computed per token), so no position
    the runner feeds (every one below the model's context) reads past them. `query_seqlens`
    (onnxruntime 1.32) says that every row's S new tokens are all real: GroupQueryAttention
    then rotates each by its own `position_ids` entry, a left-padded row of a first prompt
    included (without it, that case takes each row's first position and counts up), and takes
    a batch of several rows with several new tokens each after a past (which it refuses
    otherwise). The caller includes this pass only where the onnxruntime that runs the graph
    has that input (`kvforge.toolchain.build`).

    A partial rotation (the first rotary_dim channels of each head) moves too, where rotary_dim
    is a multiple of 16. Left as they are: a layer whose query or key is normalized between the
    Split and the rotation (gemma3, qwen3, olmo2), an interleaved rotation, one of other than a
    multiple of 16 channels (the kernel takes tables of a multiple of 8 columns), tables not
    computed from `position_ids` alone, and tables over `max_positions` larger than `MAX_TABLE_BYTES`.
    """

    MAX_TABLE_BYTES = 64 << 20  # both tables of one rotation: a context of 128k at head size 64 in float32

    def __init__(self, max_positions: int, position_input: str = "position_ids", ids_input: str = "input_ids") -> None:
        super().__init__()
        if max_positions < 1:
            raise ValueError(f"max_positions must be a positive number of positions, got {max_positions}")
        self.max_positions = max_positions
        self.position_input = position_input
        self.ids_input = ids_input

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        positions, ids = _graph_inputs(graph, self.position_input, self.ids_input)
        if positions is None or ids is None:
            return PassResult(model, modified=False)
        tables = PositionTables(graph, positions, self.max_positions)
        moved = 0
        for node in list(graph):
            found = self._rotated_split(node)
            if found is None:
                continue
            split, q_rotary, k_rotary, freqs, rotary_dim = found
            packed, dtype = split.inputs[0], q_rotary.inputs[0].dtype if q_rotary.inputs[0] else None
            if self.max_positions * rotary_dim * (dtype.itemsize if dtype is not None else 4) > self.MAX_TABLE_BYTES:
                continue
            made = tables.of(freqs, dtype)
            if made is None:
                continue
            seqlens = node.inputs[5]
            assert seqlens is not None  # GroupQueryAttention requires it
            # S per row, from values every layer shares, so that one copy serves all after CSE
            new_tokens = ir.node("Shape", [ids], attributes={"start": 1, "end": 2})
            as_int32 = ir.node("Cast", [new_tokens.outputs[0]], attributes={"to": ir.DataType.INT32})
            rows = ir.node("Shape", [seqlens])
            per_row = ir.node("Expand", [as_int32.outputs[0], rows.outputs[0]])
            graph.insert_before(node, [new_tokens, as_int32, rows, per_row])
            per_row.outputs[0].dtype, per_row.outputs[0].shape = ir.DataType.INT32, seqlens.shape
            inputs: list[ir.Value | None] = list(node.inputs) + [None] * (17 - len(node.inputs))
            inputs[0:3] = [packed, None, None]
            inputs[7:10] = [made[0], made[1], positions]
            inputs[16] = per_row.outputs[0]
            node.resize_inputs(17)
            for index, value in enumerate(inputs):
                node.replace_input_with(index, value)
            node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
            graph.remove([q_rotary, k_rotary, split], safe=True)
            moved += 1
        return PassResult(model, modified=moved > 0)

    @staticmethod
    def _rotated_split(node: ir.Node) -> tuple[ir.Node, ir.Node, ir.Node, ir.Value, int] | None:
        """(split, q's rotation, k's rotation, freqs, rotary_dim) when `node` is a GroupQueryAttention over the
        rotated first two and the plain third output of one Split of a [B,S,(H+2Hkv)*D] value
        into exactly those parts, read nowhere else, rotated alike (all channels or the first
        rotary_dim, a multiple of 16) and not interleaved; None otherwise."""
        if (node.domain, node.op_type) != ("com.microsoft", "GroupQueryAttention") or len(node.inputs) < 7:
            return None
        if _attribute(node, "do_rotary", 0) or len(node.inputs) > 12 and any(v is not None for v in node.inputs[12:]):
            return None
        q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
        q_rotary, k_rotary = (x.producer() if x is not None else None for x in (q, k))
        if q_rotary is None or k_rotary is None or v is None:
            return None
        freqs = table_frequencies(q_rotary)
        if freqs is None or table_frequencies(k_rotary) is not freqs:
            return None
        if _attribute(q_rotary, "interleaved", 0) or _attribute(k_rotary, "interleaved", 0):
            return None
        split = v.producer()
        if split is None or (split.domain, split.op_type) != ("", "Split") or len(split.outputs) != 3:
            return None
        if split.inputs[0] is None:
            return None
        if [q_rotary.inputs[0], k_rotary.inputs[0], v] != list(split.outputs):
            return None
        if any(
            len(value.uses()) != 1 or value.is_graph_output()
            for value in (*split.outputs, q_rotary.outputs[0], k_rotary.outputs[0])
        ):
            return None
        heads, kv_heads = _attribute(node, "num_heads", 0), _attribute(node, "kv_num_heads", 0)
        sizes = ir.convenience.get_const_tensor(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else None
        if _attribute(split, "axis", 0) not in (-1, 2) or sizes is None or not heads or not kv_heads:
            return None
        head_dim = int(sizes.numpy().reshape(-1)[0]) // heads
        if [int(x) for x in sizes.numpy().reshape(-1)] != [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]:
            return None
        # 0: every channel; onnxruntime's kernel takes tables of a multiple of 8 columns
        rotated = {_attribute(r, "rotary_embedding_dim", 0) or head_dim for r in (q_rotary, k_rotary)}
        if len(rotated) != 1 or (rotary_dim := rotated.pop()) > head_dim or rotary_dim % 16:
            return None
        if freqs.shape is None or freqs.shape[-1] != rotary_dim // 2:
            return None
        return split, q_rotary, k_rotary, freqs, rotary_dim


class PastLengthFromMask(InPlacePass):
    """Read the past length as `attention_mask` length minus `input_ids` length, not from
    the past tensors' shape.

    Equal under the `concat` contract; under the `shared` one the past tensor is the whole
    preallocated buffer, so its length says nothing about how many positions are filled.
    Rewrites `Shape(past_key_values.*, start=2, end=3)`, the only form the canonical
    graph reads it in. Only pasts whose positions dimension is `past_dim` are read so: a
    layer bounded by a sliding window (dimension `window_past` in the contract) keeps a past
    tensor of its own, whose length is what it holds, and its reads stay.
    """

    def __init__(
        self,
        mask_input: str = "attention_mask",
        ids_input: str = "input_ids",
        past_prefix: str = "past_key_values.",
        past_dim: str = "past",
    ) -> None:
        super().__init__()
        self._past_dim = past_dim  # not in the pass report: it names no setting of a build
        self.mask_input = mask_input
        self.ids_input = ids_input
        self.past_prefix = past_prefix

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        mask, ids = _graph_inputs(graph, self.mask_input, self.ids_input)
        if mask is None or ids is None:
            return PassResult(model, modified=False)
        reads = [
            node
            for node in graph
            if node.op_type == "Shape"
            and node.domain == ""
            and node.inputs[0] is not None
            and node.inputs[0].is_graph_input()
            and (node.inputs[0].name or "").startswith(self.past_prefix)
            and _positions_dim(node.inputs[0]) in (self._past_dim, None)
            and _attribute(node, "start", 0) == 2
            and _attribute(node, "end", None) == 3
        ]
        for node in reads:
            total = ir.node("Shape", [mask], attributes={"start": 1, "end": 2})
            seq = ir.node("Shape", [ids], attributes={"start": 1, "end": 2})
            past = ir.node("Sub", [total.outputs[0], seq.outputs[0]])
            graph.insert_before(node, [total, seq, past])
            past.outputs[0].type, past.outputs[0].shape = node.outputs[0].type, node.outputs[0].shape
            node.outputs[0].replace_all_uses_with(past.outputs[0], replace_graph_outputs=True)
            graph.remove(node, safe=True)
        return PassResult(model, modified=bool(reads))


def _positions_dim(past: ir.Value) -> str | None:
    """The name of a [batch, heads, positions, dim] value's positions dimension, if it has one."""
    shape = past.shape
    if shape is None or len(shape) != 4 or isinstance(shape[2], int):
        return None
    return str(shape[2])


class GroupQueryAttentionOutput(pattern.RewriteRuleClassBase):
    """The heads round trip after GroupQueryAttention collapses to its [B, S, H*D] output.

    ```
    out [B,S,H*D] ─► Reshape [B,S,H,D] ─► Transpose ─► Reshape (same shape) ─► Transpose ─► Reshape [B,S,H*D]
    ```
    becomes `out`: the lowering split the heads back out for the model's own
    `transpose(1, 2).reshape(B, S, H*D)`, which undoes exactly that.
    """

    def __init__(self) -> None:
        super().__init__("GroupQueryAttentionOutput", remove_nodes=False)

    def pattern(self, op: Any, out: Any, split: Any, same: Any, merged: Any) -> Any:
        heads_first = op.Transpose(op.Reshape(out, split), perm=_BHSD_TO_BSHD, _outputs=["heads_first"])
        again = op.Reshape(heads_first, same, _allow_other_attributes=True, _outputs=["again"])
        return op.Reshape(
            op.Transpose(again, perm=_BHSD_TO_BSHD), merged, _allow_other_attributes=True, _outputs=["merged_out"]
        )

    def check(  # type: ignore[override]
        self, context: Any, out: Any, heads_first: Any, again: Any, merged_out: Any, **_: Any
    ) -> MatchResult:
        result = MatchResult()
        producer = out.producer()
        if producer is None or (producer.domain, producer.op_type) != ("com.microsoft", "GroupQueryAttention"):
            return result.fail("not the output of a GroupQueryAttention", out)
        if heads_first.shape is None or heads_first.shape != again.shape:
            return result.fail("the middle Reshape is not known to keep the shape", again)
        if any(_is_read(v) and len(v.uses()) != 1 for v in (heads_first, again)):
            return result.fail("an intermediate of the round trip is read elsewhere", again)
        b, h, s, d = heads_first.shape
        expected = (b, s, h * d) if isinstance(h, int) and isinstance(d, int) else None
        if merged_out.shape is None or expected is None or tuple(merged_out.shape) != expected:
            return result.fail(
                f"the merged result is not [batch, seq, heads*head_dim] ({merged_out.shape})", merged_out
            )
        return result

    def rewrite(self, op: Any, out: Any, **_: Any) -> Any:
        return op.Identity(out)


class AttentionToTensorScatter(_CachedAttentionLowering):
    """A standard `Attention` with cache becomes a `TensorScatter` cache update (opset 24)
    into a fixed-size buffer, and an `Attention` over the whole buffer.

    ```
    y, present_k, present_v = Attention(q, k, v, mask, past_k, past_v)
    ```
    becomes
    ```
    w = T - S per row                                   (the write index: past length)
    present_k = TensorScatter(past_k, k, w, axis=-2)    [B, Hkv, capacity, D]; same for v
    y = Attention(q, present_k, present_v, Pad(mask, to capacity, False))
    ```
    Standard ops only, and the cache never grows: past and present may be one buffer
    (the contract's `shared` mode), which is the form TensorRT's KV-cache update layer
    takes. Rows keep their padding slots, so one write index serves the whole batch.
    """

    def __init__(self) -> None:
        super().__init__("AttentionToTensorScatter", remove_nodes=False)

    def check(  # type: ignore[override]
        self, context: Any, mask: Any, y: Any, **_: Any
    ) -> MatchResult:
        result = MatchResult()
        attention = y.producer()
        if not self._common_check(attention, result, "the fixed-size cache"):
            return result
        if mask is None or mask.dtype != ir.DataType.BOOL or mask.shape is None or len(mask.shape) != 4:
            return result.fail("the mask is not a 4-D boolean [batch, 1, seq, total]", attention)
        return result

    def rewrite(self, op: Any, q: Any, k: Any, v: Any, mask: Any, past_k: Any, past_v: Any, y: Any, **_: Any) -> Any:
        attention = y.producer()
        total = op.Shape(mask, start=3, end=4)
        written = op.Sub(total, op.Shape(q, start=2, end=3))
        write_indices = op.Expand(written, op.Shape(q, start=0, end=1))
        present_k = op.TensorScatter(past_k, k, write_indices, axis=-2, mode="linear")
        present_v = op.TensorScatter(past_v, v, write_indices, axis=-2, mode="linear")
        free = op.Sub(op.Shape(past_k, start=2, end=3), total)
        pads = op.Concat(op.Constant(value_ints=[0] * 7), free, axis=0)
        full_mask = op.Pad(mask, pads, op.Constant(value=ir.tensor(np.array(False))))
        attributes = {name: attr.value for name, attr in attention.attributes.items()}
        return op.Attention(q, present_k, present_v, full_mask, **attributes), present_k, present_v


class RequireOpset(InPlacePass):
    """Raise the default-domain opset import to `version` when an op of that opset is present."""

    def __init__(self, version: int, op_types: tuple[str, ...]) -> None:
        super().__init__()
        self.version = version
        self.op_types = op_types

    def call(self, model: ir.Model) -> PassResult:
        needed = any(n.op_type in self.op_types and n.domain == "" for n in model.graph)
        if not needed or model.opset_imports.get("", 0) >= self.version:
            return PassResult(model, modified=False)
        model.opset_imports[""] = self.version
        return PassResult(model, modified=True)


def attention_fusion() -> FusionPass:
    return FusionPass(
        "attention",
        {
            "attention_gqa_cache": AttentionWithCache.rule(repeat=True),
            "attention_mha_cache": AttentionWithCache.rule(repeat=False),
        },
    )


def attention_scatter() -> FusionPass:
    return FusionPass("attention_scatter", {"tensor_scatter_cache": AttentionToTensorScatter.rule()})


def attention_lowering_ort() -> FusionPass:
    return FusionPass(
        "attention_ort",
        {
            "group_query_attention": AttentionToGroupQueryAttention.rule(),
            "group_query_attention_output": GroupQueryAttentionOutput.rule(),
        },
    )
