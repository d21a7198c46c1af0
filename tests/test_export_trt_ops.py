"""Every node of the exported ONNX verify step against onnx-tensorrt's operator support table
(docs/operators.md at onnx/onnx-tensorrt 96e781103cfc4adf4a6bb557e94bac8e693f6f4c, TensorRT 10.0,
opsets 9-20): the op is listed as supported, each input's type is in its "Supported Types" column,
and an ``axes`` input that the table requires to be an initializer / constant is one. What the table
refuses would be listed in KNOWN_BLOCKERS (and in docs/export.md); it is empty: the test fails when
any refused node appears."""
import onnx
import pytest

import specgraph
from capture_harness import Driver
from specgraph.export import export_onnx
from test_capture import tiny_model

ALL = {"FP32", "FP16", "BF16", "INT32", "INT64", "BOOL"}
NUM = ALL - {"BOOL"}
FLOAT = {"FP32", "FP16", "BF16"}
AXES = "axes must be an initializer"
# op -> (supported types, index of an input the table requires constant, or None); the table's rows
# for the ops specgraph's export emits (plus the integer bitwise ops, "N" in the table)
TABLE = {
    "Add": (NUM, None), "Sub": (NUM, None), "Mul": (NUM, None), "Div": (NUM, None), "Neg": (NUM, None),
    "And": ({"BOOL"}, None), "Or": ({"BOOL"}, None), "Not": ({"BOOL"}, None),
    "ArgMax": (NUM, None), "Cast": ({"FP32", "FP16", "BF16", "INT32", "INT64", "UINT8", "BOOL"}, None),
    "Clip": (FLOAT, None), "Concat": (ALL, None), "Expand": (ALL, None), "Gather": (ALL, None),
    "GatherElements": (ALL, None), "GatherND": (ALL, None), "Identity": (ALL, None), "Reshape": (ALL, None),
    "Transpose": (ALL, None), "Where": (ALL, None), "Split": (ALL, None),
    "Cos": (FLOAT, None), "Sin": (FLOAT, None), "Sqrt": (FLOAT, None), "Pow": (FLOAT, None),
    "Reciprocal": (FLOAT, None), "Sigmoid": (FLOAT, None), "Softmax": (FLOAT, None), "MatMul": (FLOAT, None),
    "IsInf": (FLOAT, None), "IsNaN": (NUM, None), "Gelu": (NUM | {"INT8"}, None),
    "Equal": (NUM, None), "Greater": (NUM, None), "GreaterOrEqual": (NUM, None), "Less": (NUM, None),
    "Pad": (NUM, 3), "ReduceMax": (NUM, 1), "ReduceMean": (NUM, 1), "ReduceSum": (NUM, 1),
    "Slice": (ALL, 3), "Squeeze": (ALL, 1), "Unsqueeze": (ALL, 1),
    "ScatterElements": (NUM, None),
}
UNSUPPORTED = {"BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitShift"}
NAMES = {onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16",
         onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.BOOL: "BOOL",
         onnx.TensorProto.UINT8: "UINT8", onnx.TensorProto.DOUBLE: "DOUBLE", onnx.TensorProto.INT8: "INT8"}
# what blocks TensorRT's parser: nothing since the bit tests are traced in arithmetic
# (kernels/bitmask.arithmetic_bits) and integer clamps became Wheres (Clip is float-only in the table)
KNOWN_BLOCKERS: set[tuple[str, str]] = set()


def problems_of(path) -> set[tuple[str, str]]:
    """(op, what) for every node the table does not support."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    constant = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    found = set()
    for node in graph.node:
        if node.op_type == "Constant":
            continue
        if node.op_type in UNSUPPORTED or node.op_type not in TABLE:
            found.add((node.op_type, "unsupported" if node.op_type in UNSUPPORTED else "not in the table"))
            continue
        supported, axes = TABLE[node.op_type]
        ins = [i for i in node.input if i]
        data = ins[:1] if node.op_type in ("Gather", "GatherElements", "GatherND", "ScatterElements", "Reshape",
                                           "Expand", "Slice", "Squeeze", "Unsqueeze", "Pad", "ReduceMax",
                                           "ReduceMean", "ReduceSum", "Split", "Clip") else ins
        if node.op_type == "Where":
            data = ins[1:]
        for name in data:
            kind = NAMES.get(types.get(name), f"type {types.get(name)}")
            if kind not in supported:
                found.add((node.op_type, kind))
        if node.op_type == "Cast":
            to = NAMES.get(next(a.i for a in node.attribute if a.name == "to"), "?")
            if to not in supported:
                found.add((node.op_type, f"to {to}"))
        if axes is not None and len(node.input) > axes and node.input[axes] and node.input[axes] not in constant:
            found.add((node.op_type, AXES))
    return found


@pytest.mark.parametrize("arch,nodes", [("llama", 8), ("gemma3", 8), ("qwen3", 8),
                                       pytest.param("llama", 1, marks=pytest.mark.slow)])  # slow: llama-8's ops
def test_every_exported_node_is_in_the_tensorrt_onnx_table(arch, nodes, tmp_path):
    driver = Driver(tiny_model(arch), batch=2, max_length=96, seed=3)
    path = export_onnx(driver.capture, specgraph.Chain(nodes - 1), tmp_path / "step.onnx", batch=2)
    found = problems_of(path)
    assert not any(what == "not in the table" or what == AXES for _, what in found), found
    assert found == KNOWN_BLOCKERS, found


def test_the_check_sees_a_blocker(tmp_path):
    """The checker itself: a float Clip passes, an int64 Clip and a BitwiseAnd are caught."""
    h = onnx.helper
    nodes = [h.make_node("Clip", ["x", "lo"], ["y"]), h.make_node("Clip", ["i", "ilo"], ["j"]),
             h.make_node("BitwiseAnd", ["i", "i"], ["k"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
                                      h.make_tensor_value_info("i", onnx.TensorProto.INT64, [2])],
                         [h.make_tensor_value_info(n, t, [2]) for n, t in (("y", 1), ("j", 7), ("k", 7))],
                         [h.make_tensor("lo", onnx.TensorProto.FLOAT, [], [0.0]),
                          h.make_tensor("ilo", onnx.TensorProto.INT64, [], [0])])
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]), tmp_path / "g.onnx")
    assert problems_of(tmp_path / "g.onnx") == {("Clip", "INT64"), ("BitwiseAnd", "unsupported")}
