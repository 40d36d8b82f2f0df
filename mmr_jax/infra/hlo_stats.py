"""What a compiled program's optimized HLO says it does: bytes written by kind of op, custom calls.

`compiled.as_text()` of `jax.jit(f).lower(...).compile()` is the program after the target's own
compiler (XLA:GPU with the CUDA plugin, libtpu's for a TPU, also on compile-only devices:
infra/aot_targets.py): fusions formed, layouts assigned, buffers aliased, custom calls (cuBLAS
GEMMs, cuDNN attention, Mosaic kernels) in place. `parse` reads that text; the functions below
answer the questions a GPU profile answered before, without a device:

- `writes`: every op that runs, with the bytes it writes a call and how often it runs (a while
  loop's body counts its known trip count: the layer scan runs once per layer).
- `bytes_by_kind` and `layout_share`: the bytes written by transpose, copy, concatenate and pad
  ops as a share of the bytes written by all ops (a fusion is of the kind of its root op, as XLA
  names it: `loop_transpose_fusion`, `input_concatenate_fusion`).
- `custom_calls`: each custom call's target and operand shapes (is cuDNN's fused attention there,
  at which lengths?).

Bytes written is an estimate of memory traffic, not of time: reads are not counted, and an op in
place (a dynamic-update-slice into a donated buffer) counts only what it updates.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

# Bytes an element of each HLO element type; sub-byte types round up (they are rare here).
DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
LAYOUT_KINDS = ("transpose", "copy", "concatenate", "pad")
# Ops that write no buffer of their own (aliases, control flow whose bodies are counted, async
# starts whose done writes the result).
_NO_WRITE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
    "call", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%?([\w.\-]+) = (.*)$", re.DOTALL)
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result type as printed: `bf16[8,128]{1,0}` or a tuple `(f32[2], u8[0])`
    opcode: str
    operands: tuple[str, ...]  # operand instruction names
    attrs: str  # everything after the operands
    is_root: bool = False
    operand_text: str = ""  # between the parentheses as printed (a constant's value)

    def attr(self, key: str) -> str | None:
        """The computation named by `key=%name` (calls, body, condition), or None."""
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def custom_call_target(self) -> str | None:
        m = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        return m.group(1) if m else None


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, tuple[Instruction, ...]]
    entry: str
    header: str  # the `HloModule` line (input_output_alias: what the program donates)

    def root(self, computation: str) -> Instruction:
        insts = self.computations[computation]
        return next((i for i in insts if i.is_root), insts[-1])

    def by_name(self, computation: str) -> dict[str, Instruction]:
        return {i.name: i for i in self.computations[computation]}


@dataclasses.dataclass(frozen=True)
class Write:
    """One op's output: `bytes` each time it runs, `count` runs a call of the program."""

    instruction: Instruction
    computation: str
    kind: str
    bytes: int
    count: int

    @property
    def total(self) -> int:
        return self.bytes * self.count


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in HLO: {text[:200]!r}")


def _instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _closing(rest, op.end() - 1)
    inside = rest[op.end() : close]
    operands = tuple(re.findall(r"%([\w.\-]+)", inside))
    return Instruction(name, shape, op.group(1), operands, rest[close + 1 :], is_root, inside)


def parse(text: str) -> Module:
    """The computations of an HLO module's text (`compiled.as_text()`). An instruction may span
    several lines (a Mosaic kernel's backend_config does): lines that neither start an
    instruction nor close the computation continue the one before."""
    computations: dict[str, list[str]] = {}
    entry, current, header = None, None, ""
    for line in text.splitlines():
        if current is None:
            if line.startswith("HloModule"):
                header = line
            elif (m := _COMPUTATION.match(line)) and not line.startswith(" "):
                current = m.group(2)
                computations[current] = []
                entry = current if m.group(1) else entry
        elif line.rstrip() == "}":
            current = None
        elif _INSTRUCTION.match(line) or not computations[current]:
            computations[current].append(line)
        else:
            computations[current][-1] += "\n" + line
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    parsed = {
        name: tuple(i for i in map(_instruction, lines) if i is not None)
        for name, lines in computations.items()
    }
    return Module(parsed, entry, header)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (element type, dims) of each array in a printed shape (a tuple has several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def shape_bytes(shape: str) -> int:
    return sum(DTYPE_BYTES[t] * math.prod(d) for t, d in arrays(shape))


def execution_counts(module: Module) -> dict[str, int]:
    """How often each computation that runs ops (not a fusion's body) runs a call: the entry
    once, a while body its known trip count times its caller's count (1 when XLA does not know
    it), each branch of a conditional as often as the conditional (an upper bound)."""
    counts: dict[str, int] = collections.Counter()

    def visit(comp: str, times: int) -> None:
        counts[comp] += times
        for inst in module.computations[comp]:
            if inst.opcode == "while":
                visit(inst.attr("body"), times * trip_count(module, inst))
            elif inst.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
                names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
                names += [inst.attr("true_computation"), inst.attr("false_computation")]
                for name in filter(None, names):
                    visit(name, times)
            elif inst.opcode in ("call", "async-start"):  # the wrapped op runs here
                callee = inst.attr("to_apply") or inst.attr("calls")
                if callee in module.computations:
                    visit(callee, times)

    visit(module.entry, 1)
    return dict(counts)


def trip_count(module: Module, loop: Instruction) -> int:
    """A while loop's trip count: XLA's `known_trip_count` (GPU), else the N of a condition
    `counter < N` on a constant (TPU prints no count; the project's loops are scans from 0 by
    1), else 1."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    cond = loop.attr("condition")
    if cond not in module.computations:
        return 1
    names = module.by_name(cond)
    root = module.root(cond)
    if root.opcode == "compare" and "direction=LT" in root.attrs and len(root.operands) == 2:
        bound = names.get(root.operands[1])
        if bound is not None and bound.opcode == "constant" and bound.operand_text.isdigit():
            return int(bound.operand_text)
    return 1


def _look_through(inst: Instruction, names: dict[str, Instruction]) -> Instruction:
    """The op behind a bitcast (a view, not a kernel)."""
    while inst.opcode == "bitcast" and inst.operands and inst.operands[0] in names:
        inst = names[inst.operands[0]]
    return inst


def _in_place_bytes(inst: Instruction, names: dict[str, Instruction]) -> int | None:
    """What an in-place update writes: the update's bytes (None for other ops)."""
    update = {"dynamic-update-slice": 1, "scatter": -1}.get(inst.opcode)
    if update is None or not inst.operands:
        return None
    operand = names.get(inst.operands[update])
    return shape_bytes(operand.shape) if operand else None


def _output_writes(module: Module, comp: str, inst: Instruction) -> list[tuple[str, int]]:
    """[(kind, bytes)] that one run of `inst` writes: a fusion per output, of its root's kind."""
    op = inst.opcode
    # an async pair writes its result at the done (an async-start's wrapped op is counted in
    # its own computation)
    if op in _NO_WRITE or op.endswith("-start") or op == "async-done":
        return []
    if op.endswith("-done"):
        return [(op[: -len("-done")], shape_bytes(inst.shape))]
    if op == "custom-call":
        return [(f"custom-call {inst.custom_call_target}", shape_bytes(inst.shape))]
    if op == "fusion" and inst.attr("calls") in module.computations:
        fused = inst.attr("calls")
        names = module.by_name(fused)
        root = _look_through(module.root(fused), names)
        outputs = [names[o] for o in root.operands] if root.opcode == "tuple" else [root]
        out = []
        for o in outputs:
            hero = _look_through(o, names)
            in_place = _in_place_bytes(hero, names)
            out.append((hero.opcode, shape_bytes(o.shape) if in_place is None else in_place))
        return out
    in_place = _in_place_bytes(inst, module.by_name(comp))
    return [(op, shape_bytes(inst.shape) if in_place is None else in_place)]


def writes(module: Module) -> list[Write]:
    """Every output of every op that runs in a call of the program (see `execution_counts`)."""
    out = []
    for comp, count in execution_counts(module).items():
        for inst in module.computations[comp]:
            for kind, nbytes in _output_writes(module, comp, inst):
                out.append(Write(inst, comp, kind, nbytes, count))
    return out


def bytes_by_kind(module: Module) -> dict[str, int]:
    """Bytes written a call, by kind of op (custom calls by target), largest first."""
    totals: dict[str, int] = collections.Counter()
    for w in writes(module):
        totals[w.kind] += w.total
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def layout_share(by_kind: dict[str, int]) -> float:
    """Bytes written by transpose, copy, concatenate and pad ops over the bytes of all ops."""
    total = sum(by_kind.values())
    return sum(by_kind.get(k, 0) for k in LAYOUT_KINDS) / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class CustomCall:
    name: str
    target: str
    operand_shapes: tuple[str, ...]  # as printed, one per operand
    result_shape: str
    count: int  # runs a call of the program


def custom_calls(module: Module, target_pattern: str = "") -> list[CustomCall]:
    """The custom calls that run (target matching the regular expression `target_pattern`)."""
    out = []
    for comp, count in execution_counts(module).items():
        names = module.by_name(comp)
        for inst in module.computations[comp]:
            target = inst.custom_call_target
            if inst.opcode != "custom-call" or not re.search(target_pattern, target or ""):
                continue
            shapes = tuple(names[o].shape if o in names else "?" for o in inst.operands)
            out.append(CustomCall(inst.name, target, shapes, inst.shape, count))
    return out


def largest_writes(module: Module, n: int = 10) -> list[Write]:
    """The `n` single outputs with the most bytes (each run counted once)."""
    return sorted(writes(module), key=lambda w: -w.bytes)[:n]
