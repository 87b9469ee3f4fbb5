"""Weight-only quantization of the token-embedding table: the lookup reads block-wise codes.

The table `[V, H]` is quantized exactly as an LM head reading it is (`quantize_blockwise`,
blocks of `block_size` along H, the same rounding, scales float16 where the table is float32
and they fit, `half_scales_fit`, else in the table's dtype), and the
`Gather` that looks token ids up in it reads the codes in the form the target takes:

- `gather_block_quantized` (onnxruntime targets): com.microsoft `GatherBlockQuantized`, which
  reads MatMulNBits' layout (onnxruntime docs/ContribOperators.md; uint8 data needs
  `gather_axis` 0 and `quantize_axis` the last axis): uint8 codes packed low nibble first,
  unsigned (the default zero point of uint8 data is 2^(bits-1), as MatMulNBits'), scales
  `[V, blocks]` in the output dtype, zero points packed like the codes.

  ```
  table [V,H] float ──────────────► Gather(axis 0) ◄── input_ids
  B [V, blocks·block·bits/8] uint8, scales [V, blocks] ─► GatherBlockQuantized(bits, block_size,
                                                  gather_axis 0, quantize_axis 1) ◄── input_ids
                                                  ─► [Slice to H: when H is not a multiple of the block]
  ```

  A table quantized here is its own, also when a 4-bit LM head is tied to it: onnxruntime
  holds a B that another op reads beside the head's prepacked copy at run time, which measured
  larger than a table of its own, whose rows are read from the file's memory map only as they
  are looked up (docs/performance.md, "Kernel choices behind the passes"). Where a tied head
  is at 8 bits (an 8-bit build, or the default mix, which keeps it there:
  `kvforge.passes.storage.shared_head`, `TIED_TABLE` on its codes), the lookup reads the head's
  codes instead (`shared` in `counts`): one 8-bit matrix, at 4 bits in fewer bytes than a 4-bit
  table and a 4-bit head of their own, as Q4_K_M stores a tied table, for the resident memory of
  its codes beside the prepacked copy. A table the checkpoint ships quantized (`imported`: a
  GGUF file's) that the tied head's `MatMulNBits` holds as the same record is read from the
  head's initializers instead, so the artifact keeps the file's codes once, as the file does:

  ```
  B [V, blocks, block·bits/8] uint8 ───────────────► MatMulNBits (the LM head)
       └─────────────────────────────────────────► GatherBlockQuantized(gather_axis 0,
  scales [V, blocks] ─► Reshape [V, blocks, 1] ───►   quantize_axis 2) ◄── input_ids
                                                  ─► Reshape [..., blocks·block] [─► Slice to H]
  ```

- `gather_dequantize_linear` (the portable target, standard ops): ONNX's `Gather` takes no
  4-bit type (opset 21 added int4 to Reshape, Transpose, DequantizeLinear and a few others,
  not to Gather), so the codes are 8-bit: int8, or uint8 with zero points when asymmetric.

  ```
  table [V,H] float ─► Gather(axis 0) ◄── input_ids ─► [batch, seq, H]
  codes [V,H] int8, scales [V, blocks] ─► Gather(axis 0) ◄── input_ids   (each)
      ─► DequantizeLinear(axis -1, block_size) ─► [batch, seq, H]
  ```

  The table is its own here too: a tied LM head's `DequantizeLinear` initializers are not shared,
  because onnxruntime fuses `DequantizeLinear` + `MatMul` into `MatMulNBits` only when
  nothing else reads them (measured: shared, the head ran as a DequantizeLinear of its whole
  weight at every step, then a float MatMul). Dequantizing the whole table before one
  Gather would be valid ONNX too, but onnxruntime does not fold DequantizeLinear: it would
  dequantize all V rows at every step.

Only float tables that `Gather` looks `input_ids` up in (directly or through reshapes and
casts) are token-embedding tables: learned position tables and rotary caches stay as they are.
A table is skipped, with the reason in `skipped`, when it is not a constant 2-D float
initializer, is gathered along another axis, or is also read by anything but such Gathers
(a tied LM head left at full precision: quantizing the lookup would add a copy to the float
table the head keeps). `keep` is `QuantizeWeights`': a glob matching the table's name, or
`embeddings` (every token-embedding table, whatever its name), keeps it at full precision,
and so does `lm_head` a tied table, which the kept head reads.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from kvforge.passes.quantize import (
    BITS,
    BLOCK_SIZES,
    IMPORTED_RECORD,
    IMPORTED_SOURCE,
    LM_HEAD,
    TIED_TABLE,
    QuantizedWeight,
    QuantizeWeights,
    WeightQuantization,
    _lm_head,
    _remove_if_unused,
    holds_block,
    matmul_nbits_inputs,
    quantize_blockwise,
    quantize_free_min,
    read_as,
    register_initializer,
    register_once,
    register_quantized,
    replace_node,
    stored_scales,
)
from kvforge.passes.storage import TABLE_BLOCK, half_scales_fit, table_block

EMBEDDING_FORMS = ("gather_block_quantized", "gather_dequantize_linear")
EMBEDDINGS = "embeddings"  # in `keep`: every token-embedding table, whatever its name
TOKEN_IDS = "input_ids"
_MS_DOMAIN = "com.microsoft"
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# Ops the token ids may pass through on their way to the lookup (gpt2 reshapes them first).
_ID_PASSTHROUGH = frozenset({"Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten"})


class QuantizeEmbedding(QuantizeWeights):
    """Quantize every token-embedding table `Gather` reads; `counts` says what happened to each
    (`quantized`, `kept`, `skipped`).

    A `QuantizeWeights` for lookups: the same settings and the same report (`counts`,
    `skipped`), so the pipeline reports it and `--explain` lists its skips the same way.
    """

    def __init__(
        self,
        bits: int,
        block_size: int = 32,
        symmetric: bool = True,
        form: str = "gather_block_quantized",
        keep: tuple[str, ...] = (),
        imported: dict[str, QuantizedWeight] | None = None,
        only_imported: bool = False,
        free_min: bool = False,
    ) -> None:
        InPlacePass.__init__(self)
        if bits not in BITS or block_size not in (*BLOCK_SIZES, TABLE_BLOCK) or form not in EMBEDDING_FORMS:
            raise ValueError(f"unsupported embedding quantization: bits={bits}, block_size={block_size}, form={form!r}")
        if form == "gather_dequantize_linear" and bits != 8:
            raise ValueError("gather_dequantize_linear stores 8-bit codes: ONNX's Gather takes no 4-bit type")
        self.bits = bits
        self.block_size = block_size
        self.symmetric = symmetric
        self.form = form
        # 4-bit blocks with a float minimum (`quantize_free_min`), where the lookup form takes 4
        # bits and hidden is whole blocks: each row's block minimums are looked up beside it
        self.free_min = free_min and bits == 4 and form == "gather_block_quantized"
        self.keep = ",".join(keep)
        self._keep = keep
        self.counts: Counter[str] = Counter()
        self.skipped: dict[str, str] = {}
        self.forms = {}  # the table's form is --block-size's, never chosen per weight
        # A table a checkpoint ships quantized (a GGUF file's token_embd: `imported`, by the
        # table's name) is looked up with its own codes and scales where they are symmetric
        # blocks the lookup reads, quantized otherwise; `only_imported`: the other tables stay.
        # `imported_forms` says what each imported table got, as ImportQuantizedWeights does.
        self._imported = imported or {}
        self._only_imported = only_imported
        self.imported_forms: dict[str, dict[str, object]] = {}

    @classmethod
    def from_weights(
        cls, weights: WeightQuantization, form: str, imported: dict[str, QuantizedWeight] | None = None
    ) -> QuantizeEmbedding:
        """The lookup's counterpart of `weights.make_pass`: 8-bit codes where the form gathers
        standard types (an int4 request stores the table at 8 bits, the bytes its 4-bit codes
        would take once widened for Gather, with a finer step), or where `--int8 embeddings`
        asks for them; 4-bit codes `GatherBlockQuantized` looks up in blocks of `table_block`."""
        bits = 8 if form == "gather_dequantize_linear" or EMBEDDINGS in weights.int8 else weights.bits
        block = table_block(form, bits, weights.block_size, weights.free_min)
        symmetric = weights.without_zero_points
        return cls(bits, block, symmetric, form, weights.keep, imported, free_min=weights.free_min)

    def call(self, model: ir.Model) -> PassResult:
        self.counts = Counter()
        self.skipped = {}
        self.imported_forms = {}
        graph = model.graph
        tables: dict[ir.Value, list[ir.Node]] = {}
        for node in graph:
            if node.op_type == "Gather" and node.domain == "" and len(node.inputs) == 2:
                table, ids = node.inputs
                if table is not None and ids is not None and _token_ids(ids) and not _looks_up_quantized(node):
                    tables.setdefault(table, []).append(node)
        head = _lm_head(graph) if LM_HEAD in self._keep else None
        modified = False
        for table, gathers in tables.items():
            reason = self._table_skip_reason(table, gathers, head)
            record = self._record(table)
            if not reason and record is None and self._only_imported:
                reason = "kept: the checkpoint ships it in no form the lookup reads"
            if reason:
                self.skipped[table.name or ""] = reason
                self.counts["kept" if reason.startswith("kept") else "skipped"] += 1
                continue
            tied = None if record is not None or self.form != "gather_block_quantized" else _tied_head(graph, table)
            self.counts["imported" if record is not None else "shared" if tied is not None else "quantized"] += 1
            if tied is not None:  # a head at 8 bits, one matrix for both (`shared_head`)
                self._look_up_in_head(model, gathers, *tied)
                _remove_if_unused(graph, table)
            else:
                self._rewrite(model, table, gathers, record)
            modified = True
        return PassResult(model, modified=modified)

    def _record(self, table: ir.Value) -> QuantizedWeight | None:
        """The checkpoint's record of `table`, where the lookup holds it as it is: symmetric
        codes in blocks GatherBlockQuantized reads (8-bit for the standard Gather form)."""
        q = self._imported.get(table.name or "")
        tensor = table.const_value
        if q is None or tensor is None or q.codes.shape != tuple(tensor.shape.numpy()):
            return None
        if (
            q.zero_points is not None
            or q.mins is not None
            or q.input_order is not None
            or not holds_block(q.block_size)
        ):
            return None
        if self.form == "gather_dequantize_linear" and q.bits != 8:
            return None
        return q

    def _table_skip_reason(self, table: ir.Value, gathers: list[ir.Node], head: ir.Node | None) -> str:
        name = table.name or ""
        if EMBEDDINGS in self._keep or any(fnmatch.fnmatchcase(name, pattern) for pattern in self._keep):
            return "kept at full precision (--keep)"
        tensor = table.const_value
        if not table.is_initializer() or table.is_graph_input() or tensor is None:
            return "the table is not a constant initializer"
        if len(tensor.shape) != 2:
            return f"the table has shape {tensor.shape}, not [vocab, hidden]"
        for gather in gathers:
            axis = gather.attributes.get_int("axis", 0)
            if axis not in (0, -2):
                return f"{gather.op_type}({gather.name}) gathers along axis {axis}, not the table's rows"
        others = [user for user, _ in table.uses() if user not in gathers]
        if others and head is not None and all(_feeds(user, head) for user in others):
            return "kept at full precision (--keep lm_head: the tied LM head reads it)"
        if others or table.is_graph_output():
            readers = sorted({f"{user.op_type}({user.name})" for user in others})
            return f"also read at full precision by {', '.join(readers) or 'the graph output'}"
        return ""

    def _rewrite(
        self, model: ir.Model, table: ir.Value, gathers: list[ir.Node], record: QuantizedWeight | None
    ) -> None:
        graph = model.graph
        tensor = table.const_value
        assert tensor is not None
        ranked = all(gather.inputs[1].shape is not None for gather in gathers)  # type: ignore[union-attr]
        # float16 scales where the table is float32 and they fit (`half_scales_fit`), as the LM
        # head's: every form reads the scales through a Cast folded at load
        rows = tensor.numpy()
        half = record is None and rows.dtype == np.float32 and half_scales_fit(rows, self.block_size, self.bits)
        scale_dtype = np.dtype(np.float16) if half else rows.dtype
        self.scale_bytes = scale_dtype.itemsize  # the report's: what a scale of the table takes
        if record is None and self.free_min and ranked and tensor.shape.numpy()[1] % self.block_size == 0:
            q = quantize_free_min(rows, self.block_size, dtype=scale_dtype)
        elif record is None:
            q = quantize_blockwise(rows, self.bits, self.block_size, self.symmetric, scale_dtype=scale_dtype)
        held = None if record is None or self.form != "gather_block_quantized" else _head_reading(graph, record)
        head = None if held is None else held[0]
        if record is not None:  # the codes the head holds where it holds them (regrouped, perhaps)
            q = record if held is None else held[1]
            q = replace(q, scales=stored_scales(q.scales, tensor.dtype.numpy()))
        name = _free_name(graph, f"{table.name}.q{q.bits}")
        if record is not None:
            # the names the checkpoint gives this very record (a table tied to the LM head has two)
            sources = sorted(n for n, r in self._imported.items() if r is record)
            self.imported_forms[name] = {
                "form": self.form,
                "bits": q.bits,
                "block_size": q.block_size,
                "zero_points": False,
                "from": sources,
            }
            if head is not None:
                self.imported_forms[name]["codes_of"] = head.inputs[1].name  # type: ignore[union-attr]
            if held is not None and held[1] is not record:  # the head's import rounded them again
                self.imported_forms[name]["regrouped"] = sources
        if head is not None:
            self._look_up_in_head(model, gathers, head, q)
        elif self.form == "gather_block_quantized":
            b, scales, zero_points = matmul_nbits_inputs(q)
            data, *rest = register_quantized(graph, name, [b.reshape(b.shape[0], -1), scales, zero_points])
            if rest:
                rest[0] = read_as(graph, rest[0], tensor.dtype)
            # a free minimum's [V, blocks, 1], looked up beside the rows
            mins = None
            if q.mins is not None:
                mins = register_initializer(graph, f"{name}.mins", q.mins[..., None].astype(tensor.dtype.numpy()))
            model.opset_imports.setdefault(_MS_DOMAIN, 1)
            for gather in gathers:
                replace_node(graph, gather, self._gather_block_quantized(graph, gather, data, rest, q, mins))
        else:
            # codes [V, H] (int8 when symmetric, uint8 with zero points), scales and zero points [V, blocks]
            values = register_quantized(graph, name, [q.codes, q.scales, q.zero_points])
            values[1] = read_as(graph, values[1], tensor.dtype)
            for gather in gathers:
                replace_node(graph, gather, self._gather_dequantize(graph, gather, values, q.block_size))
        _remove_if_unused(graph, table)

    def _look_up_in_head(self, model: ir.Model, gathers: list[ir.Node], head: ir.Node, q: QuantizedWeight) -> None:
        """Each of `gathers` as a lookup of the codes the LM head's MatMulNBits `head` holds (`q`)."""
        model.opset_imports.setdefault(_MS_DOMAIN, 1)
        for gather in gathers:
            replace_node(model.graph, gather, self._gather_head_codes(model.graph, gather, head, q))

    # --- gather_block_quantized ------------------------------------------------------------------

    def _gather_block_quantized(
        self,
        graph: ir.Graph,
        gather: ir.Node,
        data: ir.Value,
        rest: list[ir.Value],
        q: QuantizedWeight,
        mins: ir.Value | None,
    ) -> ir.Value:
        ids = gather.inputs[1]
        assert ids is not None
        attributes = {"bits": q.bits, "block_size": q.block_size, "gather_axis": 0, "quantize_axis": 1}
        lookup = ir.node("GatherBlockQuantized", [data, ids, *rest], attributes, domain=_MS_DOMAIN)
        graph.insert_before(gather, lookup)
        hidden = q.codes.shape[1]
        if mins is not None:
            return _add_mins(graph, gather, lookup.outputs[0], mins, hidden, q.block_size)
        if hidden % q.block_size == 0:
            return lookup.outputs[0]
        return self._cut(graph, gather, lookup.outputs[0], hidden)

    def _cut(self, graph: ir.Graph, gather: ir.Node, rows: ir.Value, hidden: int) -> ir.Value:
        """`rows` of whole blocks (as the codes hold them) cut to the table's H."""
        bounds = [
            register_once(graph, f"gather_block_quantized_{part}", np.array([value], np.int64))
            for part, value in (("start", 0), (f"end_{hidden}", hidden), ("axis", -1))
        ]
        cut = ir.node("Slice", [rows, *bounds])
        graph.insert_before(gather, cut)
        return cut.outputs[0]

    def _gather_head_codes(self, graph: ir.Graph, gather: ir.Node, head: ir.Node, q: QuantizedWeight) -> ir.Value:
        """The rows of a table whose codes the LM head's MatMulNBits holds: its B
        `[V, blocks, block * bits / 8]` and scales `[V, blocks]` as they are, read along their
        last axis (`quantize_axis` 2, the scales reshaped to `[V, blocks, 1]`), the rows'
        blocks joined back to `[..., H]`."""
        ids, (data, scales) = gather.inputs[1], head.inputs[1:3]
        assert ids is not None and ids.shape is not None and data is not None and scales is not None
        per_block = register_once(graph, "gather_block_quantized_scales_per_block", np.array([0, 0, 1], np.int64))
        blocked_scales = ir.node("Reshape", [scales, per_block])
        attributes = {"bits": q.bits, "block_size": q.block_size, "gather_axis": 0, "quantize_axis": 2}
        lookup = ir.node("GatherBlockQuantized", [data, ids, blocked_scales.outputs[0]], attributes, domain=_MS_DOMAIN)
        rank, hidden, padded = len(ids.shape), q.codes.shape[1], q.padded_codes().shape[1]
        joined = register_once(graph, f"joined_rows_{rank}_{padded}", np.array([0] * rank + [padded], np.int64))
        rows = ir.node("Reshape", [lookup.outputs[0], joined])
        for node in (blocked_scales, lookup, rows):
            graph.insert_before(gather, node)
        return rows.outputs[0] if hidden == padded else self._cut(graph, gather, rows.outputs[0], hidden)

    # --- gather_dequantize_linear ----------------------------------------------------------------

    def _gather_dequantize(self, graph: ir.Graph, gather: ir.Node, values: list[ir.Value], block: int) -> ir.Value:
        ids = gather.inputs[1]
        assert ids is not None
        rows = []
        for value in values:
            rows_of = ir.node("Gather", [value, ids], {"axis": 0})
            graph.insert_before(gather, rows_of)
            rows.append(rows_of.outputs[0])
        dequantize = ir.node("DequantizeLinear", rows, {"axis": -1, "block_size": block})
        graph.insert_before(gather, dequantize)
        return dequantize.outputs[0]


# --- graph plumbing -------------------------------------------------------------------------------


def _add_mins(
    graph: ir.Graph, gather: ir.Node, rows: ir.Value, mins: ir.Value, hidden: int, block_size: int
) -> ir.Value:
    """`rows` [..., H] (the symmetric part of a free-minimum table's rows) plus each block's min
    term, looked up as the rows are: [..., H / block, block] + mins [..., H / block, 1]."""
    ids = gather.inputs[1]
    assert ids is not None and ids.shape is not None
    blocks = hidden // block_size
    rank = len(ids.shape)
    split = register_once(
        graph, f"block_rows_{rank}_{blocks}_{block_size}", np.array([0] * rank + [blocks, block_size])
    )
    joined = register_once(graph, f"joined_rows_{rank}_{hidden}", np.array([0] * rank + [hidden]))
    row_mins = ir.node("Gather", [mins, ids], {"axis": 0})
    blocked = ir.node("Reshape", [rows, split])
    added = ir.node("Add", [blocked.outputs[0], row_mins.outputs[0]])
    joined_rows = ir.node("Reshape", [added.outputs[0], joined])
    for node in (row_mins, blocked, added, joined_rows):
        graph.insert_before(gather, node)
    return joined_rows.outputs[0]


def _head_reading(graph: ir.Graph, record: QuantizedWeight) -> tuple[ir.Node, QuantizedWeight] | None:
    """The MatMulNBits that holds codes made from `record` (`IMPORTED_SOURCE`: the LM head tied to
    an imported table), with the scales it reads, and the record those codes hold (`record`, or
    the one the import `regrouped` it to); None where no such node is in the graph."""
    for node, codes in _symmetric_codes(graph):
        if codes.meta.get(IMPORTED_SOURCE) is record:
            held: QuantizedWeight = codes.meta[IMPORTED_RECORD]
            same = node.attributes.get_int("bits") == held.bits
            if same and node.attributes.get_int("block_size") == held.block_size:
                return node, held
    return None


def _tied_head(graph: ir.Graph, table: ir.Value) -> tuple[ir.Node, QuantizedWeight] | None:
    """The MatMulNBits of the LM head tied to `table` whose codes the lookup can read (`TIED_TABLE`
    on its B: symmetric, in blocks GatherBlockQuantized takes), with the record they hold."""
    for node, codes in _symmetric_codes(graph):
        tied = codes.meta.get(TIED_TABLE)
        if tied is not None and tied[0] == table.name and holds_block(tied[1].block_size):
            return node, tied[1]
    return None


def _symmetric_codes(graph: ir.Graph) -> Iterator[tuple[ir.Node, ir.Value]]:
    """Each MatMulNBits without zero points, with the codes B it reads (what a lookup can share)."""
    for node in graph:
        if node.op_type == "MatMulNBits" and node.domain == _MS_DOMAIN and len(node.inputs) == 3:
            codes = node.inputs[1]
            if codes is not None:
                yield node, codes


def _token_ids(value: ir.Value) -> bool:
    """Whether `value` is the graph's token ids, read directly or through reshapes and casts."""
    for _ in range(8):
        if value.is_graph_input():
            return value.name == TOKEN_IDS
        producer = value.producer()
        if producer is None or producer.domain != "" or producer.op_type not in _ID_PASSTHROUGH:
            return False
        source = producer.inputs[0] if producer.inputs else None
        if source is None:
            return False
        value = source
    return False


def _feeds(node: ir.Node, head: ir.Node) -> bool:
    """Whether `node` is the LM head or what it reads its weight through (the exported Transpose)."""
    return node is head or any(user is head for output in node.outputs for user, _ in output.uses())


def _looks_up_quantized(gather: ir.Node) -> bool:
    """Whether the Gather reads rows of a quantization already: integer codes, or the scales
    (zero points) a DequantizeLinear applies to them, as this pass's portable form does."""
    table = gather.inputs[0]
    if table is not None and table.dtype is not None and table.dtype not in _FLOATS:
        return True
    uses = gather.outputs[0].uses()
    return bool(uses) and all(user.op_type == "DequantizeLinear" and index > 0 for user, index in uses)


def _free_name(graph: ir.Graph, base: str) -> str:
    return base if base not in graph.initializers else base + ".gather"
