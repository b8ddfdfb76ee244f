"""Where an XLA kernel came from: the source lines behind each fusion of a compiled program.

A profile names XLA's kernels by fusion ("loop_pad_fusion_141"); the compiled HLO text
(`jitted.lower(...).compile().as_text()`) holds, for every instruction, the Python stack
that traced it. `fusion_sources` maps each fusion's kernel name to the lines of this
repository its instructions came from, so a profile's small launches can be read as
"the pad in moe_block" rather than by number.
"""

from __future__ import annotations

import collections
import re

_REPO_DIRS = ("jspec/", "pallas_kernels/")
_SECTION = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$")
_NAMED = re.compile(r'^(\d+) "(.*)"$')
_FIELDS = re.compile(r"(\w+)=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_COPY = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) copy(?:-start)?\(")


def _kernel_name(name: str) -> str:
    """An HLO instruction's name as the profiler prints its kernel ("a.1" -> "a_1")."""
    return name.replace(".", "_").replace("-", "_")


def _tables(lines: list[str]) -> dict[str, dict[int, object]]:
    tables: dict[str, dict[int, object]] = collections.defaultdict(dict)
    section = None
    for line in lines:
        s = line.strip()
        if _SECTION.match(s):
            section = s
            continue
        if s.startswith(("%", "ENTRY")):  # the tables come before the computations
            break
        if section is None or not s:
            continue
        named = _NAMED.match(s)
        if named and section in ("FileNames", "FunctionNames"):
            tables[section][int(named.group(1))] = named.group(2)
        elif section in ("FileLocations", "StackFrames"):
            key, _, rest = s.partition(" ")
            if key.isdigit():
                tables[section][int(key)] = {k: int(v) for k, v in _FIELDS.findall(rest)}
    return tables


def _frame_text(frame: int, tables) -> str | None:
    """The innermost location of a stack frame inside this repository, "file:line (fn)",
    walking to parent frames past library code; None if the stack never enters it."""
    seen = set()
    while frame and frame not in seen:
        seen.add(frame)
        f = tables["StackFrames"].get(frame)
        if f is None:
            return None
        loc = tables["FileLocations"].get(f.get("file_location_id", 0), {})
        path = tables["FileNames"].get(loc.get("file_name_id", 0), "")
        for d in _REPO_DIRS:
            if d in path:
                fn = tables["FunctionNames"].get(loc.get("function_name_id", 0), "?")
                return f"{d}{path.split(d, 1)[1]}:{loc.get('line', 0)} ({fn})"
        frame = f.get("parent_frame_id", 0)
    return None


def fusion_sources(hlo_text: str, most: int = 4) -> dict[str, dict]:
    """Compiled HLO text -> {kernel name: {"ops": [opcode, ...], "sources": [line, ...]}}
    for every fusion instruction: the opcodes of the computation it calls (most frequent
    first) and up to `most` source lines of this repository behind them (most frequent
    first)."""
    lines = hlo_text.splitlines()
    tables = _tables(lines)
    bodies: dict[str, tuple[collections.Counter, collections.Counter]] = {}
    fusions: dict[str, str] = {}
    current = None
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            bodies[current] = (collections.Counter(), collections.Counter())
            continue
        if line.startswith("}"):
            current = None
            continue
        inst = _INSTRUCTION.match(line)
        if not inst or current is None:
            continue
        name, opcode = inst.groups()
        ops, sources = bodies[current]
        if opcode not in ("parameter", "constant", "bitcast", "get-tuple-element", "tuple"):
            ops[opcode] += 1
        frame = _FRAME.search(line)
        text = _frame_text(int(frame.group(1)), tables) if frame else None
        if text:
            sources[text] += 1
        calls = _CALLS.search(line)
        if opcode == "fusion" and calls:
            fusions[_kernel_name(name)] = calls.group(1)
    out = {}
    for kernel, comp in fusions.items():
        ops, sources = bodies.get(comp, (collections.Counter(), collections.Counter()))
        out[kernel] = {"ops": [o for o, _ in ops.most_common()],
                       "sources": [s for s, _ in sources.most_common(most)]}
    return out


def copy_sources(hlo_text: str, most: int = 64) -> list[dict]:
    """The compiled program's copy instructions outside fusions (a profile shows them as
    memcpy kernels, by no instruction name): [{"name", "shape", "sources"}], at most
    `most`, with the lines of this repository behind each (empty where the compiler
    added the copy itself, e.g. for a loop's carried buffers)."""
    lines = hlo_text.splitlines()
    tables = _tables(lines)
    fused = set()
    for line in lines:  # computations that fusions call: their copies are not launches
        calls = _CALLS.search(line)
        if calls and " fusion(" in line:
            fused.add(calls.group(1))
    out, current = [], None
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            continue
        copy = _COPY.match(line)
        if not copy or current in fused:
            continue
        frame = _FRAME.search(line)
        text = _frame_text(int(frame.group(1)), tables) if frame else None
        out.append({"name": copy.group(1), "shape": copy.group(2),
                    "sources": [text] if text else []})
        if len(out) >= most:
            break
    return out
