"""What values an integer input of an ONNX model may take, read off the graph, so that the random
inputs of the accuracy check are valid inputs of the model.

Three uses cover the models people export:

- **indices**: the input (through shape-only ops) is the ``indices`` of a ``Gather`` whose data
  is an initializer (token ids into an embedding table, token type ids, position ids): values in
  ``[0, rows)``;
- **mask**: the input is turned into floats or booleans (``Cast`` to a float type, or a
  comparison / logical op): an attention mask, 0 or 1;
- **lengths**: the ``sequence_lens`` of an LSTM / GRU / RNN: values in ``[0, seq_length]``
  (generated as indices into ``seq_length + 1`` rows).

Anything else keeps the default range. A mask of a 2-D or larger shape is generated as a padding
mask (each row some ones, then zeros), as a tokenizer produces it: a row of all zeros would mask
every key, where fp32 and fp16 softmax legitimately disagree.
"""
from __future__ import annotations

SHAPE_ONLY = {"Unsqueeze", "Squeeze", "Reshape", "Expand", "Flatten", "Identity", "Slice",
              "Transpose"}
MASK_USES = {"Equal", "Not", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or",
             "Xor", "Where", "Sub", "Mul"}
FLOAT_ELEM_TYPES = {1, 10, 11, 16}  # float32, float16, float64, bfloat16
RECURRENT = {"LSTM", "GRU", "RNN"}  # input 4: sequence_lens


def infer_input_values(model, names: list[str]) -> dict[str, tuple]:
    """{input name: ("index", rows) | ("mask",)} for the integer inputs ``names`` of ``model``
    (an onnx ModelProto) whose use the graph shows; others are absent."""
    graph = model.graph
    consumers: dict[str, list] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
    inits = {t.name: list(t.dims) for t in graph.initializer}
    inits.update(_sequence_rows(graph))  # keyed (node, "sequence_lens"): no tensor name clash
    found = {}
    for name in names:
        kind = _use_of(name, consumers, inits, set())
        if kind is not None:
            found[name] = kind
    return found


def _use_of(name: str, consumers: dict, inits: dict, seen: set) -> tuple | None:
    if name in seen:
        return None
    seen.add(name)
    rows, mask = None, False
    for node, slot in consumers.get(name, []):
        op = node.op_type
        if op in RECURRENT and slot == 4 and (node.name, "sequence_lens") in inits:
            n = inits[(node.name, "sequence_lens")]
            rows = n if rows is None else min(rows, n)
        elif op == "Gather" and slot == 1 and node.input[0] in inits:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = inits[node.input[0]]
            if dims:
                n = int(dims[axis % len(dims)])
                rows = n if rows is None else min(rows, n)
        elif op in SHAPE_ONLY and slot == 0 or op == "Cast" and not _casts_to_float(node):
            for out in node.output:
                inner = _use_of(out, consumers, inits, seen)
                if inner is not None and inner[0] == "index":
                    rows = inner[1] if rows is None else min(rows, inner[1])
                elif inner is not None:
                    mask = True
        elif op == "Cast" or op in MASK_USES:
            mask = True
    if rows is not None:
        return ("index", rows)
    return ("mask",) if mask else None


def _casts_to_float(node) -> bool:
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    return to in FLOAT_ELEM_TYPES


def _sequence_rows(graph) -> dict:
    """{(node name, "sequence_lens"): seq_length + 1} for each recurrent node whose X has a
    known sequence length (after shape inference)."""
    dims = {}
    for vi in list(graph.input) + list(graph.value_info):
        dims[vi.name] = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    rows = {}
    for node in graph.node:
        layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
        x = dims.get(node.input[0]) if node.op_type in RECURRENT and node.input else None
        if x and len(x) == 3 and x[layout] > 0:
            rows[(node.name, "sequence_lens")] = x[layout] + 1
    return rows
