"""Sizing the pieces: profile a traced model node by node, open or split what is too slow, group the rest.

Planning runs once at setup on the device the task landed on, on one real
batch: every node is timed forward and backward as an atom of its own (a few
runs, the first as warm-up). A module call slower than the target is opened
into its children (traced again) or, when it is a ``Linear`` or ``Conv2d``
without children, run as slices of its outputs; then the nodes are grouped
into atoms that stay under the target both ways, and the atoms into steps.

A step's kind names the work it runs, not its place in the pass: ``b20-25.9c1e``
is the backward pass through nodes 20 to 24, the suffix a digest of exactly
which nodes and slices. The runtime keeps step-time estimates per kind (and
across runs, per task and options), so a name that meant other work after a
regroup, or in a plan timed differently, would hand one piece another's
time (one VGG-19 run's estimates file had its ``b9`` at 42.6 ms once, then
3.2-3.7 ms), and a piece estimated longer than every bubble waits for a
probe.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from freeride.partition.exported import export
from freeride.partition.graph import Atom, Executor, NodeGraph, split_count, splittable, trace

__all__ = ["Plan", "Step", "group", "make_plan", "timer"]

logger = logging.getLogger(__name__)

_MAX_ROUNDS = 8
"""Rounds of opening and splitting: each goes one level deeper into the module tree."""
_NO_WORK = ("placeholder", "get_attr", "output")
"""Nodes that only name a value: never reported as slow (their time is the executor's own)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One task step: atoms run in this order, and what they were measured to take together."""

    kind: str
    atoms: tuple[int, ...]
    cost_s: float


def group(
    costs: Sequence[float], target_s: float, name: Callable[[tuple[int, ...]], str], *, reverse: bool = False
) -> list[Step]:
    """Consecutive atoms in steps as long as possible but under ``target_s`` (an atom over it alone).

    ``name`` gives the kind of a step running the given atoms (see :meth:`Plan.kind`).
    """
    order = range(len(costs) - 1, -1, -1) if reverse else range(len(costs))
    steps: list[Step] = []
    run: list[int] = []
    total = 0.0
    for k in order:
        if run and total + costs[k] > target_s:
            steps.append(Step(name(tuple(run)), tuple(run), total))
            run, total = [], 0.0
        run.append(k)
        total += costs[k]
    if run:
        steps.append(Step(name(tuple(run)), tuple(run), total))
    return steps


@dataclass(slots=True)
class Plan:
    """A traced model cut into atoms, with each atom's measured cost and the steps grouping them."""

    graph: NodeGraph
    atoms: list[Atom]
    forward_s: list[float]
    backward_s: list[float]
    target_s: float
    training: bool
    forward: list[Step]
    backward: list[Step]
    opened: tuple[str, ...] = ()
    """The modules fx traced into (qualified names): with them the graph is made again."""
    exported: bool = False
    """The graph is ``torch.export``'s, not fx's."""
    _kinds: dict[tuple[str, int, int], str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        graph: NodeGraph,
        atoms: list[Atom],
        forward_s: list[float],
        backward_s: list[float],
        *,
        target_s: float,
        training: bool,
        opened: tuple[str, ...] = (),
        exported: bool = False,
    ) -> Plan:
        plan = cls(graph, atoms, forward_s, backward_s, target_s, training, [], [], opened, exported)
        plan.regroup(1.0)
        return plan

    def regroup(self, scale: float) -> None:
        """Scale every measured cost by ``scale`` (times drifted) and group the steps again."""
        self.forward_s = [c * scale for c in self.forward_s]
        self.backward_s = [c * scale for c in self.backward_s]
        prefix = "f" if self.training else "i"
        self.forward = group(self.forward_s, self.target_s, lambda run: self.kind(prefix, run))
        self.backward = (
            group(self.backward_s, self.target_s, lambda run: self.kind("b", run), reverse=True)
            if self.training
            else []
        )

    def kind(self, prefix: str, atoms: Sequence[int]) -> str:
        """The kind of a step running ``atoms`` (consecutive atom indices, in either order) in one direction.

        ``prefix`` says which (``f`` forward, ``b`` backward, ``i`` inference).
        The name is the nodes the atoms cover, ``{prefix}{first}-{end}`` (a
        slice ``k`` of node ``n`` starts at ``n.k`` and ends at ``n.k+1``), and
        a digest of those nodes and of the atoms' bounds and slices: the same
        work in another grouping, or in another run of the same model and
        options, has the same kind; other work never does.
        """
        lo, hi = min(atoms), max(atoms)
        known = self._kinds.get((prefix, lo, hi))
        if known is not None:
            return known
        first, last = self.atoms[lo], self.atoms[hi]
        bounds = ";".join(f"{a.start}:{a.stop}:{a.part}/{a.parts}" for a in self.atoms[lo : hi + 1])
        nodes = ";".join(f"{n.op}:{n.name}" for n in self.graph.nodes[first.start : last.stop])
        digest = hashlib.blake2s(f"{bounds}|{nodes}".encode(), digest_size=2).hexdigest()
        start = f"{first.start}.{first.part}" if first.is_slice else f"{first.start}"
        end = f"{last.start}.{last.part + 1}" if last.is_slice else f"{last.stop}"
        name = self._kinds[(prefix, lo, hi)] = f"{prefix}{start}-{end}.{digest}"
        return name


def timer(device: torch.device) -> Callable[[], float]:
    """The clock pieces are timed by: on a CPU the process's CPU time, else the wall (after a sync).

    A side task on a CPU core runs at the lowest priority: a stage that wakes up mid-piece
    preempts it, and that wait is no cost of the piece (the gate takes it out of step times too).
    """
    return time.process_time if device.type == "cpu" else time.perf_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(
    graph: NodeGraph,
    atoms: list[Atom],
    x: object,
    target: object,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    device: torch.device,
    runs: int,
) -> tuple[list[float], list[float]]:
    """Each atom's forward and backward time: the median of ``runs`` runs after one warm-up run."""
    ex = Executor(graph, atoms, loss_fn)
    clock = timer(device)
    fwd: list[list[float]] = [[] for _ in atoms]
    bwd: list[list[float]] = [[] for _ in atoms]
    for run in range(runs + 1):
        ex.begin(x, target)
        with torch.set_grad_enabled(loss_fn is not None):
            for k in range(len(atoms)):
                t0 = clock()
                ex.forward(k)
                _sync(device)
                if run:
                    fwd[k].append(clock() - t0)
            if loss_fn is not None:
                for k in range(len(atoms) - 1, -1, -1):
                    t0 = clock()
                    ex.backward(k)
                    _sync(device)
                    if run:
                        bwd[k].append(clock() - t0)
        ex.reset()
    return [statistics.median(t) for t in fwd], [statistics.median(t) if t else 0.0 for t in bwd]


def _node_atoms(graph: NodeGraph, slices: dict[str, int]) -> list[Atom]:
    atoms: list[Atom] = []
    for i, node in enumerate(graph.nodes):
        parts = slices.get(str(node.target), 1) if node.op == "call_module" else 1
        atoms.extend(Atom(i, i + 1, part, parts) for part in range(parts))
    return atoms


def _merge(
    atoms: list[Atom], fwd: list[float], bwd: list[float], target_s: float
) -> tuple[list[Atom], list[float], list[float]]:
    """Runs of single-node atoms joined while both their forward and backward stay under the target."""
    out: list[Atom] = []
    out_f: list[float] = []
    out_b: list[float] = []
    start = -1
    f_sum = b_sum = 0.0
    stop = 0

    def flush() -> None:
        nonlocal start, f_sum, b_sum
        if start >= 0:
            out.append(Atom(start, stop))
            out_f.append(f_sum)
            out_b.append(b_sum)
        start, f_sum, b_sum = -1, 0.0, 0.0

    for atom, f, b in zip(atoms, fwd, bwd, strict=True):
        if atom.is_slice:
            flush()
            out.append(atom)
            out_f.append(f)
            out_b.append(b)
            continue
        if start >= 0 and (f_sum + f > target_s or b_sum + b > target_s):
            flush()
        if start < 0:
            start = atom.start
        stop = atom.stop
        f_sum += f
        b_sum += b
    flush()
    return out, out_f, out_b


def _quote(exc: BaseException) -> str:
    """An exception's message, first line, short enough for a log line."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 240 else text[:237] + "..."


def _traces(model: nn.Module, opened: set[str]) -> str:
    """Why tracing ``model`` with the modules ``opened`` traced into fails ("" where it does not)."""
    try:
        trace(model, opened)
    except Exception as exc:  # fx raises TraceError, TypeError, AttributeError, ... on untraceable code
        return _quote(exc)
    return ""


def _exported(model: nn.Module, x: object) -> NodeGraph:
    module, build = export(model, x)
    return NodeGraph(module, module.graph, build)


def _export_instead(model: nn.Module, x: object) -> NodeGraph | None:
    """``model`` exported, where fx keeps a slow module whole; None where it cannot be exported either."""
    try:
        graph = _exported(model, x)
    except Exception as exc:
        logger.info("[partition] %s: torch.export cannot export it either (%s)", type(model).__name__, _quote(exc))
        return None
    logger.info(
        "[partition] %s: exported by torch.export, for torch.fx cannot trace into a slow module of it"
        " (a piece per ATen operation; batches must keep the first one's shapes)",
        type(model).__name__,
    )
    return graph


def _first_graph(model: nn.Module, x: object) -> NodeGraph:
    """``model`` traced by ``torch.fx`` with its children as leaves, or else exported by ``torch.export``."""
    name = type(model).__name__
    why = _traces(model, set())
    if not why:
        return NodeGraph(model, trace(model, set()))
    try:
        graph = _exported(model, x)
    except Exception as exc:
        raise ValueError(
            f"cannot partition {name}: torch.fx cannot trace its forward ({why}), nor torch.export export it"
            f" ({_quote(exc)}); where a branch on a tensor's value is the cause, move it into a submodule,"
            " which then runs as one piece"
        ) from None
    logger.info(
        "[partition] %s: torch.fx cannot trace its forward (%s): exported by torch.export instead"
        " (a piece per ATen operation; batches must keep the first one's shapes)",
        name,
        why,
    )
    return graph


def _report_slow(
    graph: NodeGraph, atoms: list[Atom], fwd: list[float], bwd: list[float], target_s: float, closed: dict[str, str]
) -> None:
    """Log each node whose atom stays over the target, with what it took and why it was not cut further."""
    seen: set[int] = set()
    for atom, f, b in zip(atoms, fwd, bwd, strict=True):
        if max(f, b) <= target_s or atom.start in seen or graph.nodes[atom.start].op in _NO_WORK:
            continue
        seen.add(atom.start)
        where = graph.where(atom.start)
        if atom.is_slice:
            why = f"each of its {atom.parts} slices"
        elif where in closed:
            why = f"torch.fx cannot trace into it ({closed[where]})"
        else:
            why = "nothing smaller to cut it into"
        logger.warning(
            "[partition] %s stays over the target: %.2f ms forward, %.2f ms backward against %.2f ms (%s)",
            where,
            f * 1e3,
            b * 1e3,
            target_s * 1e3,
            why,
        )


def make_plan(
    model: nn.Module,
    x: object,
    target: object,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    *,
    target_s: float,
    device: torch.device,
    runs: int = 2,
) -> Plan:
    """Trace ``model``, size its pieces on the batch ``(x, target)`` and group them into steps.

    The model is traced by ``torch.fx``, or exported by ``torch.export`` where
    fx cannot trace its forward, or where fx keeps a module slower than the
    target and than the rest of the model whole because it cannot trace into
    it (a wrapper around a Hugging Face model; see
    :mod:`freeride.partition.exported`). Running the model here has side
    effects a caller undoes: random draws, batch-norm statistics and parameter
    gradients.

    Raises:
        ValueError: neither ``torch.fx`` nor ``torch.export`` can take ``model``'s forward.
    """
    opened: set[str] = set()
    closed: dict[str, str] = {}
    slices: dict[str, int] = {}
    graph = _first_graph(model, x)
    for rounds in range(_MAX_ROUNDS + 1):
        atoms = _node_atoms(graph, slices)
        fwd, bwd = _profile(graph, atoms, x, target, loss_fn, device, runs)
        if rounds == _MAX_ROUNDS:
            break  # deep enough: what is still slow runs as it is
        per_node: dict[int, float] = {}
        for atom, f, b in zip(atoms, fwd, bwd, strict=True):
            per_node[atom.start] = per_node.get(atom.start, 0.0) + max(f, b)
        changed = False
        for i, cost in per_node.items():
            module = graph.module(i)
            name = str(graph.nodes[i].target)
            if module is None or cost <= target_s:
                continue
            if any(True for _ in module.children()):
                if name not in closed and name not in opened:
                    why = _traces(model, opened | {name})
                    if why:
                        logger.info("[partition] keeps %s whole: tracing into it failed: %s", name, why)
                        closed[name] = why
                    else:
                        opened.add(name)
                        changed = True
            elif splittable(module):
                parts = split_count(module, cost, target_s)
                if parts > slices.get(name, 1):
                    slices[name] = parts
                    changed = True
        if not changed:
            total = sum(per_node.values())
            if any(cost > max(target_s, total / 2) and graph.where(i) in closed for i, cost in per_node.items()):
                instead = _export_instead(model, x)
                if instead is not None:
                    graph, opened, slices = instead, set(), {}
                    atoms = _node_atoms(graph, slices)
                    fwd, bwd = _profile(graph, atoms, x, target, loss_fn, device, runs)
            break
        graph = NodeGraph(model, trace(model, opened))
    _report_slow(graph, atoms, fwd, bwd, target_s, closed)
    merged, f_costs, b_costs = _merge(atoms, fwd, bwd, target_s)
    exported = graph.model is not model  # an exported graph names the module export made
    plan = Plan.of(
        graph,
        merged,
        f_costs,
        b_costs,
        target_s=target_s,
        training=loss_fn is not None,
        opened=() if exported else tuple(sorted(opened)),
        exported=exported,
    )
    logger.info(
        "[partition] %s: %d nodes in %d atoms, %d forward and %d backward steps (target %.1f ms; %d opened, %d split)",
        type(model).__name__,
        len(graph.nodes),
        len(merged),
        len(plan.forward),
        len(plan.backward),
        target_s * 1e3,
        len(opened),
        len(slices),
    )
    return plan
